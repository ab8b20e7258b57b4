"""Batch invariance: a request's temperature-0 answer does not depend on what else the engine
decodes beside it. Eight different questions, each asked alone, then all eight at once from
eight threads on a server with eight slots: every answer must be the same text, token for
token, and the alone answers must equal `kiln-run generate`'s.
"""

import threading
import unittest

import serve_util as su

QUESTIONS = [
    "What is the capital of France?",
    "Name three fruits.",
    "Why is the sky blue?",
    "Write a haiku about snow.",
    "What is two plus two?",
    "Who wrote Hamlet?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
]
# Different budgets, so sequences end at different steps and the batch changes shape.
MAX_TOKENS = [24, 17, 24, 20, 9, 24, 13, 22]
# How long the concurrent round may take on two cores.
ROUND_TIMEOUT_S = 180


class BatchInvariance(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        su.require_files()
        # No prompt cache: a cache hit changes how a prompt is read (test_api.py checks that
        # separately); here only the batch may differ between the two rounds.
        cls.server = su.Server("--parallel", "8", "--ctx", "1024", "--cache-mb", "0")
        cls.client = cls.server.openai(timeout=ROUND_TIMEOUT_S)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def ask(self, i):
        r = self.client.chat.completions.create(
            model="kiln", messages=[{"role": "user", "content": QUESTIONS[i]}],
            max_tokens=MAX_TOKENS[i], temperature=0)
        return r.choices[0].message.content, r.usage.completion_tokens

    def test_eight_at_once_equal_each_alone(self):
        alone = [self.ask(i) for i in range(len(QUESTIONS))]
        # Alone, the server is generate: the first two checked against it (each generate loads
        # the model, so not all eight).
        for i in (0, 3):
            ref = su.generate(QUESTIONS[i], MAX_TOKENS[i])
            self.assertEqual(alone[i], (ref["text"], ref["generated_tokens"]), QUESTIONS[i])

        together = [None] * len(QUESTIONS)
        errors = []
        start = threading.Barrier(len(QUESTIONS))

        def worker(i):
            try:
                start.wait(30)
                together[i] = self.ask(i)
            except Exception as e:  # reported below, with the question
                errors.append((QUESTIONS[i], repr(e)))

        # Watch /health meanwhile: the test means something only if the answers were decoded
        # side by side.
        most_active = [0]
        done = threading.Event()

        def watch():
            while not done.is_set():
                most_active[0] = max(most_active[0], self.server.health()["active"])
                done.wait(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(QUESTIONS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(ROUND_TIMEOUT_S)
        done.set()
        watcher.join()
        self.assertGreaterEqual(most_active[0], 4, "the requests were not decoded together")
        self.assertFalse(any(t.is_alive() for t in threads), "a request did not finish")
        self.assertEqual(errors, [])
        for i, q in enumerate(QUESTIONS):
            self.assertEqual(together[i], alone[i], f"answer to {q!r} changed in a batch")
        self.server.wait_idle()


if __name__ == "__main__":
    unittest.main()
