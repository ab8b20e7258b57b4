"""The chat page at `/`, in a real browser (headless Chromium over the DevTools protocol)
against a real `kiln-run serve`: a refused request shown as an error, the API key kept for
the tab, a streamed answer equal to `kiln-run generate`'s at temperature 0 with a tokens-per-
second figure, a second turn that carries the first, Shift+Enter for a new line, Stop, and
text shown as text (never as HTML).

Set KILN_SCREENSHOT=PATH to save a screenshot of the conversation there (docs/serve-chat.png
was made so).
"""

import os
import re
import unittest
from pathlib import Path

import cdp
import serve_util as su

API_KEY = "page-test-key"
QUESTION = "What is the capital of France?"
FOLLOW_UP = "And what is it famous for?"
MAX_TOKENS = 32
# Bounded waits for one streamed answer on two cores.
ANSWER_TIMEOUT_S = 90
RATE = re.compile(r"^\d+(\.\d+)? tok/s$")

ANSWERS_DONE = """(() => {
    const done = [...document.querySelectorAll('#messages .msg.assistant')]
        .filter(li => !li.classList.contains('streaming') && li.querySelector('.meta'));
    return done.length;
})()"""


class ChatPage(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        su.require_files()
        cls.server = su.Server("--parallel", "2", "--ctx", "2048", api_key=API_KEY)
        try:
            cls.browser = cdp.Browser()
        except Exception:
            cls.server.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.browser.close()
        cls.server.stop()

    def assistant_texts(self):
        return self.browser.eval(
            "[...document.querySelectorAll('#messages .msg.assistant .text')]"
            ".map(e => e.textContent)")

    def test_conversation(self):
        b = self.browser
        b.open(self.server.url + "/")
        self.assertEqual(b.eval("document.title"), "Kiln chat")
        # The page loads nothing from elsewhere: every resource is the page itself.
        resources = b.eval("performance.getEntriesByType('resource').map(r => r.name)")
        self.assertEqual([r for r in resources if not r.startswith(self.server.url)], [])

        # 1. Without the key: the 401 is shown in the page, and no answer is kept.
        b.type_into("#input", QUESTION)
        b.click("#send")
        error = b.wait_for("document.querySelector('#messages .msg.error .text')?.textContent",
                           30, "the error message")
        self.assertIn("401", error)
        self.assertEqual(self.assistant_texts(), [])
        self.assertEqual(b.eval("document.querySelector('#input').value"), "")

        # 2. Settings: the key (kept in sessionStorage), greedy sampling, a short answer.
        b.eval("document.getElementById('settings').open = true")
        b.type_into("#api-key", API_KEY)
        b.eval("document.getElementById('api-key').dispatchEvent(new Event('change'))")
        self.assertEqual(b.eval("sessionStorage.getItem('kiln-api-key')"), API_KEY)
        b.eval(f"""document.getElementById('temperature').value = '0';
                   document.getElementById('max-tokens').value = '{MAX_TOKENS}';
                   document.getElementById('settings').open = false;""")

        # 3. The question again, sent with the Send button: streamed, equal to generate's.
        b.type_into("#input", QUESTION)
        b.click("#send")
        b.wait_for(f"{ANSWERS_DONE} >= 1", ANSWER_TIMEOUT_S, "the first answer")
        ref = su.generate(QUESTION, MAX_TOKENS)
        self.assertEqual(self.assistant_texts(), [ref["text"]])
        tps = b.eval("document.getElementById('tps').textContent")
        self.assertRegex(tps, RATE)
        self.assertGreater(float(tps.split()[0]), 0)
        first_prompt = self.prompt_tokens(0)
        self.assertEqual(first_prompt, ref["prompt_tokens"])

        # 4. Shift+Enter is a new line, not a send.
        b.type_into("#input", "line one")
        b.press_enter(shift=True)
        self.assertIn("\n", b.eval("document.getElementById('input').value"))
        self.assertEqual(b.eval("document.querySelectorAll('#messages .msg.user').length"), 2)
        b.eval("document.getElementById('input').value = ''")

        # 5. A follow-up sent with Enter carries the first turn: its prompt is longer than the
        #    first prompt and answer together. The user's text is shown as text, not HTML.
        follow = "<b>" + FOLLOW_UP + "</b>"
        b.type_into("#input", follow)
        b.press_enter()
        b.wait_for(f"{ANSWERS_DONE} >= 2", ANSWER_TIMEOUT_S, "the second answer")
        self.assertGreater(self.prompt_tokens(1), first_prompt + 5)
        users = b.eval("[...document.querySelectorAll('#messages .msg.user .text')]"
                       ".map(e => e.textContent)")
        self.assertEqual(users[-1], follow)
        self.assertEqual(b.eval("document.querySelectorAll('#messages b').length"), 0)
        self.assertTrue(self.assistant_texts()[1])
        self.assertRegex(b.eval("document.getElementById('tps').textContent"), RATE)

        shot = os.environ.get("KILN_SCREENSHOT")
        if shot:
            b.eval("document.getElementById('input').blur()")
            png = b.screenshot()
            self.assertEqual(png[:8], b"\x89PNG\r\n\x1a\n")
            Path(shot).write_bytes(png)

        # 6. Stop aborts a long answer: the page says so, keeps what arrived, and the server
        #    frees the slot.
        b.eval("document.getElementById('max-tokens').value = '2000'")
        b.type_into("#input", "Tell me a long story about a dragon who learns to bake bread.")
        b.click("#send")
        b.wait_for("(document.querySelectorAll('#messages .msg.assistant .text')[2]"
                   "?.textContent || '').length > 20", ANSWER_TIMEOUT_S, "the story to start")
        b.click("#stop")
        b.wait_for(f"{ANSWERS_DONE} >= 3", 30, "the stopped answer")
        meta = b.eval("[...document.querySelectorAll('#messages .msg.assistant .meta')]"
                      ".map(e => e.textContent)")
        self.assertEqual(meta[2], "stopped")
        self.assertFalse(b.eval("document.getElementById('send').disabled"))
        self.assertTrue(b.eval("document.getElementById('stop').disabled"))
        self.server.wait_idle(timeout=30)
        self.assertEqual(b.eval("document.querySelectorAll('#messages .msg.error').length"), 1)

    def prompt_tokens(self, i):
        """The prompt size the page reports under answer `i` (from the stream's usage)."""
        meta = self.browser.eval(
            f"document.querySelectorAll('#messages .msg.assistant .meta')[{i}].textContent")
        m = re.search(r"(\d+) prompt \+ (\d+) tokens", meta)
        self.assertIsNotNone(m, meta)
        return int(m.group(1))


if __name__ == "__main__":
    unittest.main()
