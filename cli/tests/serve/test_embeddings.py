"""`kiln-run serve` on an embedding model: `/v1/embeddings` through the official `openai`
client (whose default is base64) and raw HTTP, held to `kiln-run embed`'s vectors bit for bit
and to sentence-transformers' within the F32 tolerance; refusals by field; concurrent clients
answered as each alone; a full queue answered 503 rather than waited on; a client that hangs up
mid-request costing nothing after. Everything talks to 127.0.0.1 and stops by itself.

    KILN_EMBED_MODEL  the F32 all-MiniLM-L6-v2 .kiln (default: target/embeddings/minilm-f32.kiln,
                      made by ci/embeddings.sh)
"""

import base64
import json
import os
import socket
import subprocess
import threading
import time
import unittest

import numpy as np

import serve_util as su

MODEL = os.environ.get("KILN_EMBED_MODEL", str(su.ROOT / "target/embeddings/minilm-f32.kiln"))
REFERENCE = su.ROOT / "fixtures/reference/minilm/embeddings.json"
# Each round of concurrent requests must end within this.
ROUND_TIMEOUT_S = 120


def cli_vectors(texts, *extra):
    """`kiln-run embed`'s vectors for `texts`, as float32."""
    args = [str(su.KILN_RUN), "embed", MODEL, *su.thread_args(), *extra]
    for t in texts:
        args += ["-p", t]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=120)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    return np.array([r["embedding"] for r in rows], dtype=np.float32)


def vectors_of(response_json):
    """The float32 vectors of a raw `/v1/embeddings` response, in index order (either
    encoding)."""
    data = sorted(response_json["data"], key=lambda d: d["index"])
    out = []
    for d in data:
        e = d["embedding"]
        if isinstance(e, str):
            out.append(np.frombuffer(base64.b64decode(e), dtype="<f4"))
        else:
            out.append(np.array(e, dtype=np.float32))
    return np.array(out)


class Embeddings(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        for path in (su.KILN_RUN, MODEL):
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} is missing: run ci/embeddings.sh, or set "
                                        f"KILN_BIN and KILN_EMBED_MODEL")
        with open(REFERENCE) as f:
            cls.ref = json.load(f)
        cls.texts = [r["text"] for r in cls.ref["rows"]]
        cls.server = su.Server("--queue", "6", "--timeout", "60", model=MODEL)
        cls.client = cls.server.openai(timeout=ROUND_TIMEOUT_S)
        cls.cli = cli_vectors(cls.texts)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def post(self, body, **kw):
        return self.server.json("POST", "/v1/embeddings", body, **kw)

    def test_openai_client_equals_kiln_run_embed_and_sentence_transformers(self):
        # One reference text is longer than the model's 256 tokens: sentence-transformers
        # cuts it, and so does the server when asked.
        r = self.client.embeddings.create(model="minilm", input=self.texts,
                                          extra_body={"truncate": True})
        got = np.array([d.embedding for d in r.data], dtype=np.float32)
        self.assertEqual([d.index for d in r.data], list(range(len(self.texts))))
        self.assertEqual(got.shape, self.cli.shape)
        np.testing.assert_array_equal(got, self.cli)
        ref = np.array([row["embedding"] for row in self.ref["rows"]], dtype=np.float64)
        cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
        self.assertGreaterEqual(cos.min(), 0.99999, cos)
        ids = sum(len(row["ids"]) for row in self.ref["rows"])
        self.assertEqual(r.usage.prompt_tokens, ids)
        self.assertEqual(r.usage.total_tokens, ids)
        self.assertEqual(r.model, "minilm-f32")

    def test_float_and_base64_carry_the_same_bits(self):
        texts = self.texts[:5]
        s1, floats = self.post({"input": texts, "encoding_format": "float"})
        s2, b64 = self.post({"input": texts, "encoding_format": "base64"})
        self.assertEqual((s1, s2), (200, 200))
        self.assertIsInstance(b64["data"][0]["embedding"], str)
        np.testing.assert_array_equal(vectors_of(floats), vectors_of(b64))
        np.testing.assert_array_equal(vectors_of(floats), self.cli[:5])
        norms = np.linalg.norm(vectors_of(floats).astype(np.float64), axis=1)
        np.testing.assert_allclose(norms, 1.0, atol=1e-6)

    def test_token_ids_are_taken_as_given(self):
        rows = self.ref["rows"][:3]
        status, one = self.post({"input": rows[0]["ids"]})
        self.assertEqual(status, 200, one)
        np.testing.assert_array_equal(vectors_of(one)[0], self.cli[0])
        status, many = self.post({"input": [r["ids"] for r in rows]})
        self.assertEqual(status, 200, many)
        np.testing.assert_array_equal(vectors_of(many), self.cli[:3])

    def test_normalize_false_gives_the_pooled_vector(self):
        status, raw = self.post({"input": self.texts[:2], "normalize": False})
        self.assertEqual(status, 200, raw)
        np.testing.assert_array_equal(vectors_of(raw), cli_vectors(self.texts[:2],
                                                                   "--no-normalize"))

    def test_long_input_refused_unless_truncate(self):
        long = "word " * 600
        status, err = self.post({"input": ["short", long]})
        self.assertEqual(status, 400, err)
        self.assertEqual(err["error"]["param"], "input[1]")
        self.assertIn("truncate", err["error"]["message"])
        status, cut = self.post({"input": ["short", long], "truncate": True})
        self.assertEqual(status, 200, cut)
        self.assertEqual(cut["usage"]["prompt_tokens"], 3 + 256)
        # kiln-run embed cuts at max_seq_length by default: the same vector.
        np.testing.assert_array_equal(vectors_of(cut)[1], cli_vectors([long])[0])

    def test_refusals_name_the_field(self):
        with self.assertRaises(su_openai().BadRequestError) as cm:
            self.client.embeddings.create(model="m", input="a", dimensions=128)
        self.assertEqual(cm.exception.param, "dimensions")
        for body, param in [
            ({"input": []}, "input"),
            ({}, "input"),
            ({"input": 3}, "input"),
            ({"input": ["a", None]}, "input[1]"),
            ({"input": [[101, 10 ** 6]]}, "input[0][1]"),
            ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
            ({"input": "a", "prompt_name": "query"}, "prompt_name"),
            ({"input": "a", "stream": True}, "stream"),
            ({"input": ["word " * 300]}, "input[0]"),
            ({"input": [list(range(1, 300))]}, "input[0]"),
            ({"input": ["x"] * 2049}, "input"),
            # 300 inputs of 256 tokens: more than 65,536 tokens in one request.
            ({"input": ["word " * 300] * 300, "truncate": True}, "input"),
        ]:
            status, err = self.post(body)
            self.assertEqual(status, 400, (body, err))
            self.assertEqual(err["error"]["param"], param, (body, err))
            self.assertTrue(err["error"]["message"])
        status, err = self.server.json("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hi"}]})
        self.assertEqual(status, 400, err)
        self.assertIn("embedding model", err["error"]["message"])
        status, err = self.server.json("POST", "/v1/completions", {"prompt": "hi"})
        self.assertEqual(status, 400, err)
        self.assertEqual(err["error"]["param"], "prompt")

    def test_concurrent_clients_get_what_each_gets_alone(self):
        # Twelve requests of different mixes from six threads, queue of six: every answer
        # that is given equals the one-request answer for its texts.
        jobs = [[self.texts[(i * 7 + j) % len(self.texts)] for j in range(1 + i % 5)]
                for i in range(12)]
        results = [None] * len(jobs)

        def run(k):
            for i in range(k, len(jobs), 6):
                results[i] = self.post({"input": jobs[i], "truncate": True},
                                       timeout=ROUND_TIMEOUT_S)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(ROUND_TIMEOUT_S)
            self.assertFalse(t.is_alive(), "a request hung")
        index = {t: i for i, t in enumerate(self.texts)}
        for job, (status, body) in zip(jobs, results):
            self.assertEqual(status, 200, body)
            want = self.cli[[index[t] for t in job]]
            np.testing.assert_array_equal(vectors_of(body), want)
        self.server.wait_idle()

    def test_a_full_queue_is_503_and_a_hang_up_costs_nothing(self):
        # Big requests (48 texts of 256 tokens: seconds each) from twelve threads against a
        # queue of six: some are refused at once with 503 and Retry-After, none hangs, and
        # the server is idle afterwards.
        big = {"input": [f"{i} lorem ipsum dolor sit amet " * 60 for i in range(48)],
               "truncate": True}
        codes = []

        def run():
            status, headers, body = self.server.request("POST", "/v1/embeddings", big,
                                                        timeout=ROUND_TIMEOUT_S)
            codes.append((status, headers.get("retry-after")))

        threads = [threading.Thread(target=run) for _ in range(12)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        # A client that sends a big request and hangs up at once.
        with socket.create_connection(("127.0.0.1", self.server.port)) as s:
            body = json.dumps(big).encode()
            s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: " + str(len(body)).encode()
                      + b"\r\n\r\n" + body)
        for t in threads:
            t.join(ROUND_TIMEOUT_S)
            self.assertFalse(t.is_alive(), "a request hung")
        refused = [c for c in codes if c[0] == 503]
        self.assertTrue(refused, codes)
        self.assertTrue(all(r == "1" for _, r in refused), codes)
        self.assertTrue(all(s in (200, 503) for s, _ in codes), codes)
        self.server.wait_idle(timeout=ROUND_TIMEOUT_S)
        # Served again at once, and the answer unchanged.
        status, again = self.post({"input": self.texts[:2]}, timeout=30)
        self.assertEqual(status, 200, again)
        np.testing.assert_array_equal(vectors_of(again), self.cli[:2])
        self.assertLess(time.monotonic() - t0, ROUND_TIMEOUT_S)
        self.assertTrue(self.server.alive())

    def test_health_and_models(self):
        h = self.server.health()
        self.assertEqual(h["status"], "ok")
        models = self.client.models.list()
        self.assertEqual([m.id for m in models.data], ["minilm-f32"])


def su_openai():
    import openai
    return openai


if __name__ == "__main__":
    unittest.main()
