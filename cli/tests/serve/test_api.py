"""`kiln-run serve`'s OpenAI-compatible API, spoken to by the official `openai` client (and by
raw HTTP where a client would refuse to send the request), on the real SmolLM2.

The reference for every temperature-0 answer is `kiln-run generate --temp 0 --json` with the
same question and token budget: same text, same token counts.
"""

import json
import unittest

import jsonschema
import openai

import serve_util as su

API_KEY = "kiln-test-key"
# Small budgets keep the suite quick on two cores; long enough for a sentence.
N = 24
QUESTION = "What is the capital of France? Answer in one sentence."
SYSTEM = "You are a terse geography teacher."

server = None


# Prompts are read in chunks of 8 tokens, by the server and by the references alike, so that
# the prompt cache (which reuses whole chunks by default) is exercised by short chats.
BATCH = 8


def gen(*args, **kw):
    """`kiln-run generate`'s reference output, reading prompts as the server does."""
    return su.generate(*args, batch=BATCH, **kw)


def setUpModule():
    global server
    su.require_files()
    server = su.Server("--parallel", "2", "--ctx", "2048", "-b", str(BATCH), api_key=API_KEY)


def tearDownModule():
    if server is not None:
        server.stop()


def chat(client, question=QUESTION, system=None, **kw):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}]
    return client.chat.completions.create(model="kiln", messages=messages, **kw)


class Chat(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.client = server.openai()
        cls.ref = gen(QUESTION, N)
        cls.ref_system = gen(QUESTION, N, system=SYSTEM)

    def test_models_lists_the_model(self):
        models = self.client.models.list()
        self.assertGreaterEqual(len(models.data), 1)
        self.assertTrue(models.data[0].id)

    def test_non_streamed_equals_generate(self):
        r = chat(self.client, max_tokens=N, temperature=0)
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(len(r.choices), 1)
        c = r.choices[0]
        self.assertEqual(c.message.role, "assistant")
        self.assertEqual(c.message.content, self.ref["text"])
        self.assertEqual(c.finish_reason, "length" if self.ref["stop"] == "length" else "stop")
        self.assertEqual(r.usage.prompt_tokens, self.ref["prompt_tokens"])
        self.assertEqual(r.usage.completion_tokens, self.ref["generated_tokens"])
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)

    def test_system_prompt_equals_generate_with_system(self):
        r = chat(self.client, system=SYSTEM, max_tokens=N, temperature=0)
        self.assertEqual(r.choices[0].message.content, self.ref_system["text"])
        self.assertEqual(r.usage.prompt_tokens, self.ref_system["prompt_tokens"])
        self.assertEqual(r.usage.completion_tokens, self.ref_system["generated_tokens"])

    def test_early_stop_equals_generate(self):
        # A question the model answers in fewer tokens than it may: finish_reason "stop", and
        # the stop token counted in completion_tokens as generate counts it.
        q = "Reply with only the word yes."
        ref = gen(q, 32)
        r = chat(self.client, q, max_tokens=32, temperature=0)
        self.assertEqual(r.choices[0].message.content, ref["text"])
        self.assertEqual(r.usage.completion_tokens, ref["generated_tokens"])
        self.assertEqual(r.choices[0].finish_reason, "stop" if ref["stop"] == "eos" else "length")

    def test_prompt_cache_hit_equals_generate(self):
        # A second question shares the template's system turn with the first: the server reads
        # that prefix (whole chunks of it) from its prompt cache, and the answer must still be
        # generate's, bit for bit.
        q = "Write a haiku about snow."
        ref = gen(q, 20)
        chat(self.client, "What is the capital of Italy?", max_tokens=2, temperature=0)
        r = chat(self.client, q, max_tokens=20, temperature=0)
        self.assertGreater(r.usage.prompt_tokens_details.cached_tokens, 0)
        self.assertEqual(r.choices[0].message.content, ref["text"])

    def test_streamed_chunks(self):
        stream = chat(self.client, max_tokens=N, temperature=0, stream=True,
                      stream_options={"include_usage": True})
        chunks = list(stream)
        self.assertGreaterEqual(len(chunks), 3)
        ids = {c.id for c in chunks}
        self.assertEqual(len(ids), 1, f"chunk ids differ: {ids}")
        for c in chunks:
            self.assertEqual(c.object, "chat.completion.chunk")
        # The first chunk carries the role.
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        # The last chunk is the usage chunk: no choices, the counts.
        last = chunks[-1]
        self.assertEqual(last.choices, [])
        self.assertIsNotNone(last.usage)
        self.assertEqual(last.usage.prompt_tokens, self.ref["prompt_tokens"])
        self.assertEqual(last.usage.completion_tokens, self.ref["generated_tokens"])
        body = chunks[:-1]
        for c in body:
            self.assertIsNone(c.usage, "usage on a chunk before the last")
            self.assertEqual(len(c.choices), 1)
        # Exactly one finish chunk, the last with a choice.
        finishes = [c.choices[0].finish_reason for c in body]
        self.assertTrue(finishes[-1] in ("length", "stop"), finishes)
        self.assertTrue(all(f is None for f in finishes[:-1]), finishes)
        text = "".join(c.choices[0].delta.content or "" for c in body)
        self.assertEqual(text, self.ref["text"])

    def test_streamed_without_usage_has_no_usage_chunk(self):
        chunks = list(chat(self.client, max_tokens=8, temperature=0, stream=True))
        self.assertTrue(all(c.usage is None for c in chunks))
        self.assertTrue(all(len(c.choices) == 1 for c in chunks))
        self.assertIsNotNone(chunks[-1].choices[0].finish_reason)

    def test_raw_stream_is_sse_ending_in_done(self):
        status, headers, body = server.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4,
            "temperature": 0, "stream": True})
        self.assertEqual(status, 200)
        self.assertTrue(headers.get("content-type", "").startswith("text/event-stream"),
                        headers)
        events = su.sse_events(body)
        self.assertEqual(events[-1], "[DONE]")
        for e in events[:-1]:
            json.loads(e)

    def test_multi_turn(self):
        # A follow-up with the earlier turns: the prompt is longer by those turns, and the
        # answer is a continuation the server accepts.
        first = chat(self.client, max_tokens=N, temperature=0)
        messages = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And of Italy?"}]
        r = self.client.chat.completions.create(model="kiln", messages=messages,
                                                max_tokens=8, temperature=0)
        self.assertGreater(r.usage.prompt_tokens,
                           first.usage.prompt_tokens + first.usage.completion_tokens - 2)
        self.assertTrue(r.choices[0].message.content)

    def test_logprobs(self):
        r = chat(self.client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertTrue(content)
        n = r.usage.completion_tokens
        if r.choices[0].finish_reason == "length":
            self.assertEqual(len(content), n)
        else:  # the stop token may or may not be listed
            self.assertIn(len(content), (n - 1, n))
        for t in content:
            self.assertLessEqual(t.logprob, 0.0)
            self.assertEqual(len(t.top_logprobs), 3)
            tops = [x.logprob for x in t.top_logprobs]
            self.assertEqual(tops, sorted(tops, reverse=True))
            self.assertTrue(all(x <= 0.0 for x in tops))
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(t.logprob, tops[0], places=4)
            self.assertEqual(t.token, t.top_logprobs[0].token)

    def test_json_schema_response_validates(self):
        schema = {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "country": {"type": "string"},
                "continent": {"enum": ["Africa", "America", "Asia", "Europe", "Oceania"]},
                "is_capital": {"type": "boolean"},
            },
            "required": ["city", "country", "continent", "is_capital"],
            "additionalProperties": False,
        }
        r = chat(self.client, "Give the capital of France, its country and continent as JSON.",
                 max_tokens=96, temperature=0,
                 response_format={"type": "json_schema",
                                  "json_schema": {"name": "capital", "schema": schema,
                                                  "strict": True}})
        self.assertEqual(r.choices[0].finish_reason, "stop", r.choices[0].message.content)
        value = json.loads(r.choices[0].message.content)
        jsonschema.validate(value, schema)

    def test_json_object_response_parses(self):
        r = chat(self.client, "Describe a cat as a JSON object.", max_tokens=96,
                 temperature=0, response_format={"type": "json_object"})
        self.assertEqual(r.choices[0].finish_reason, "stop", r.choices[0].message.content)
        self.assertIsInstance(json.loads(r.choices[0].message.content), dict)

    def test_sampled_answers_follow_the_seed(self):
        a = chat(self.client, max_tokens=12, temperature=0.9, seed=7)
        b = chat(self.client, max_tokens=12, temperature=0.9, seed=7)
        self.assertEqual(a.choices[0].message.content, b.choices[0].message.content)


class Completions(unittest.TestCase):
    PROMPT = "The three primary colors are"

    @classmethod
    def setUpClass(cls):
        cls.client = server.openai()

    def test_temperature_zero_equals_generate(self):
        ref = gen(self.PROMPT, 16, chat=False)
        r = self.client.completions.create(model="kiln", prompt=self.PROMPT, max_tokens=16,
                                           temperature=0)
        self.assertEqual(r.object, "text_completion")
        self.assertEqual(r.choices[0].text, ref["text"])
        self.assertEqual(r.usage.prompt_tokens, ref["prompt_tokens"])
        self.assertEqual(r.usage.completion_tokens, ref["generated_tokens"])

    def test_ignore_eos_gives_exactly_max_tokens(self):
        ref = gen("Say yes.", 40, chat=False, ignore_eos=True)
        r = self.client.completions.create(model="kiln", prompt="Say yes.", max_tokens=40,
                                           temperature=0, extra_body={"ignore_eos": True})
        self.assertEqual(r.usage.completion_tokens, 40)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.choices[0].text, ref["text"])

    def test_logprobs(self):
        r = self.client.completions.create(model="kiln", prompt=self.PROMPT, max_tokens=6,
                                           temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.tokens), 6)
        self.assertEqual(len(lp.token_logprobs), 6)
        self.assertTrue(all(x <= 0.0 for x in lp.token_logprobs), lp.token_logprobs)
        self.assertEqual("".join(lp.tokens), r.choices[0].text)
        for top in lp.top_logprobs:
            self.assertEqual(len(top), 2)
            self.assertTrue(all(v <= 0.0 for v in top.values()))

    def test_streamed_completion_equals_non_streamed(self):
        whole = self.client.completions.create(model="kiln", prompt=self.PROMPT,
                                               max_tokens=12, temperature=0)
        chunks = list(self.client.completions.create(
            model="kiln", prompt=self.PROMPT, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        self.assertEqual(text, whole.choices[0].text)
        self.assertEqual(chunks[-1].usage.completion_tokens, whole.usage.completion_tokens)


class Tokenize(unittest.TestCase):
    def test_round_trip(self):
        text = "Kiln runs models on the CPU."
        status, value = server.json("POST", "/tokenize", {"content": text})
        self.assertEqual(status, 200, value)
        tokens = value["tokens"]
        self.assertTrue(tokens and all(isinstance(t, int) for t in tokens), tokens)
        status, value = server.json("POST", "/detokenize", {"tokens": tokens})
        self.assertEqual(status, 200, value)
        self.assertEqual(value["content"], text)

    def test_completion_prompt_tokens_match_tokenize(self):
        text = "One, two, three, four"
        _, value = server.json("POST", "/tokenize", {"content": text})
        r = server.openai().completions.create(model="kiln", prompt=text, max_tokens=1,
                                               temperature=0)
        # The completion may add a beginning-of-sequence token the plain tokenization lacks.
        self.assertIn(r.usage.prompt_tokens - len(value["tokens"]), (0, 1))


class Refusals(unittest.TestCase):
    """Every refused request is an OpenAI-shaped error naming the parameter at fault."""

    @classmethod
    def setUpClass(cls):
        cls.client = server.openai()

    def bad_request(self, param, **kw):
        with self.assertRaises(openai.BadRequestError) as cm:
            chat(self.client, max_tokens=4, **kw)
        e = cm.exception
        self.assertEqual(e.status_code, 400)
        self.assertEqual(e.param, param, e.body)
        self.assertTrue(e.message)
        return e

    def test_n_2(self):
        self.bad_request("n", n=2)

    def test_tools(self):
        self.bad_request("tools", tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}}}}])

    def test_temperature_of_the_wrong_type(self):
        self.bad_request("temperature", temperature="hot")

    def test_unknown_field(self):
        self.bad_request("frobnicate", extra_body={"frobnicate": 1})

    def test_malformed_json(self):
        status, headers, body = server.request(
            "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"',
            headers={"Content-Type": "application/json"})
        self.assertEqual(status, 400, body)
        err = json.loads(body)["error"]
        self.assertTrue(err["message"])
        for key in ("type", "param", "code"):
            self.assertIn(key, err)

    def test_embeddings_from_a_generator(self):
        # A decoder has no pooling: /v1/embeddings is refused by name, not answered with
        # made-up vectors.
        with self.assertRaises(openai.BadRequestError) as cm:
            self.client.embeddings.create(model="kiln", input="hello")
        self.assertEqual(cm.exception.param, "model", cm.exception.body)
        self.assertIn("/v1/embeddings", cm.exception.message)

    def test_no_messages(self):
        status, _, body = server.request("POST", "/v1/chat/completions", {"max_tokens": 4})
        self.assertEqual(status, 400, body)
        self.assertEqual(json.loads(body)["error"]["param"], "messages")

    def test_missing_key_is_401(self):
        status, _, body = server.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, auth=False)
        self.assertEqual(status, 401, body)
        self.assertTrue(json.loads(body)["error"]["message"])

    def test_wrong_key_is_401(self):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-the-key",
                               max_retries=0, timeout=su.HTTP_TIMEOUT_S)
        with self.assertRaises(openai.AuthenticationError) as cm:
            chat(client, max_tokens=2)
        self.assertEqual(cm.exception.status_code, 401)

    def test_health_needs_no_key(self):
        h = server.health()
        self.assertEqual(h["status"], "ok")
        self.assertEqual(h["slots"], 2)
        for key in ("slots_idle", "active", "queued"):
            self.assertIsInstance(h[key], int)

    def test_unknown_path_is_404(self):
        status, _, body = server.request("GET", "/v1/nothing-here")
        self.assertEqual(status, 404, body)
        self.assertTrue(json.loads(body)["error"]["message"])

    def test_chat_page_is_served(self):
        status, headers, body = server.request("GET", "/", auth=False)
        self.assertEqual(status, 200)
        self.assertTrue(headers.get("content-type", "").startswith("text/html"), headers)
        self.assertIn(b'id="messages"', body)


if __name__ == "__main__":
    unittest.main()
