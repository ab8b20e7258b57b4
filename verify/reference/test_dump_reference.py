"""The reference-dump tool's input checks, which run before torch is loaded.

Run with any Python 3.11 (torch is not needed; CI runs these in its small venv):

    python -m unittest discover -s verify/reference -p 'test_*.py'

The dumps themselves need torch and are checked by hand against the committed fixtures
(fixtures/README.md): `fixtures/reference/make_reference.py` calls the same `dump_model`.
"""

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOL = HERE / "dump_reference.py"
TINY = HERE.parent.parent / "fixtures/tiny/llama-tied-f32"

sys.path.insert(0, str(HERE))
import dump_reference as dr  # noqa: E402


def run(*args):
    p = subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                       text=True, timeout=60)
    return p.returncode, p.stderr


class Inputs(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, text):
        p = self.dir / name
        p.write_text(text, encoding="utf-8")
        return p

    def test_prompts_file_skips_blank_lines(self):
        p = self.write("p.txt", "one\n\n  \ntwo words\n")
        self.assertEqual(dr.read_prompts(p), ["one", "two words"])

    def test_chats_file_takes_strings_and_conversations(self):
        conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        p = self.write("c.jsonl", json.dumps("Hello") + "\n\n" + json.dumps(conv) + "\n")
        self.assertEqual(dr.read_chats(p), ["Hello", conv])

    def test_chats_file_errors_name_the_line(self):
        cases = [
            ('"ok"\n{"role": "user"\n', "line 2: not JSON"),
            ('[{"role": "robot", "content": "x"}]\n', "line 1: message 0 has role 'robot'"),
            ('[{"role": "user", "content": 3}]\n', "message 0's content must be a string"),
            ('[{"role": "user"}]\n', 'exactly "role" and "content"'),
            ("[]\n", "non-empty list of messages"),
            ("42\n", "got int"),
        ]
        for text, want in cases:
            p = self.write("bad.jsonl", text)
            with self.assertRaises(dr.BadInput) as e:
                dr.read_chats(p)
            self.assertIn(want, str(e.exception))
            self.assertIn(str(p), str(e.exception))

    def test_a_directory_without_config_is_refused_with_exit_2(self):
        out = self.dir / "out"
        code, err = run("--model", self.dir, "--out", out, "--prompt", "x")
        self.assertEqual(code, 2, err)
        self.assertIn("no config.json", err)
        self.assertFalse(out.exists())

    def test_an_architecture_kiln_does_not_run_is_refused(self):
        model = self.dir / "m"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"architectures": ["T5EncoderModel"]}))
        code, err = run("--model", model, "--out", self.dir / "out", "--prompt", "x")
        self.assertEqual(code, 2, err)
        self.assertIn("T5EncoderModel", err)
        self.assertIn("Gemma3ForCausalLM", err)
        self.assertIn("BertModel", err)

    def test_an_embedding_model_takes_texts_not_chats(self):
        model = self.dir / "bert"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
        code, err = run("--model", model, "--out", self.dir / "out", "--chat", "hi")
        self.assertEqual(code, 2, err)
        self.assertIn("embedding model", err)
        self.assertIn("--prompt", err)
        self.assertFalse((self.dir / "out").exists())

    def test_a_non_empty_output_is_kept_without_force(self):
        out = self.dir / "out"
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        code, err = run("--model", TINY, "--out", out, "--prompt", "x")
        self.assertEqual(code, 2, err)
        self.assertIn("--force", err)
        self.assertEqual((out / "keep.txt").read_text(), "mine")

    def test_nothing_to_run_and_bad_layers_are_refused(self):
        code, err = run("--model", TINY, "--out", self.dir / "out")
        self.assertEqual(code, 2, err)
        self.assertIn("nothing to run", err)
        code, err = run("--model", TINY, "--out", self.dir / "out", "--prompt", "x",
                        "--detail-layers", "0,last")
        self.assertEqual(code, 2, err)
        self.assertIn("--detail-layers", err)

    def test_a_bad_chats_file_exits_2_naming_it(self):
        p = self.write("c.jsonl", "not json\n")
        code, err = run("--model", TINY, "--out", self.dir / "out", "--chats", p)
        self.assertEqual(code, 2, err)
        self.assertIn(f"{p}, line 1", err)

    @unittest.skipIf(__import__("importlib.util").util.find_spec("transformers") is not None,
                     "transformers is installed here: the missing-package message is not reached")
    def test_without_transformers_the_install_line_is_named(self):
        code, err = run("--model", TINY, "--out", self.dir / "out", "--prompt", "x")
        self.assertEqual(code, 2, err)
        self.assertIn("pip install -r verify/reference/requirements.txt", err)
        self.assertFalse((self.dir / "out").exists())


if __name__ == "__main__":
    unittest.main()
