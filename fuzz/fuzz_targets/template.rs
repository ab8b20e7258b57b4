//! Fuzz target for chat-template rendering (`kiln-run chat`, `generate --chat`).
//!
//! Each input is a template source, then a NUL byte, then a user message. The template is
//! compiled in this process (a syntax error must be an error, never a panic) and rendered the
//! way `kiln-run` renders it: in a child process under memory and CPU limits
//! (`kiln_runner::sandbox`), the release `kiln-run` named by the `KILN_RUN` environment
//! variable (`ci/fuzz.sh` builds it; the child is not built with a sanitizer, whose shadow
//! memory could not start under the child's 1 GiB address-space limit). A rendering may
//! succeed, fail, or hit a limit; what must never happen is a child that dies for any other
//! reason (a crash the limits do not explain) or a parent that panics.
#![no_main]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use kiln_runner::chat::{ChatTemplate, Message};
use kiln_runner::RunnerError;
use libfuzzer_sys::fuzz_target;

static EXE: OnceLock<PathBuf> = OnceLock::new();

fuzz_target!(
    init: {
        let exe = std::env::var_os("KILN_RUN")
            .map(PathBuf::from)
            .filter(|p| p.is_file())
            .expect("set KILN_RUN to a built kiln-run (ci/fuzz.sh does)");
        let _ = EXE.set(exe);
    },
    |data: &[u8]| {
        let (source, message) = match data.iter().position(|&b| b == 0) {
            Some(i) => (&data[..i], &data[i + 1..]),
            None => (data, &b"hi"[..]),
        };
        let source = String::from_utf8_lossy(source);
        let message = String::from_utf8_lossy(message);
        let special: BTreeMap<String, String> = [("bos_token", "<s>"), ("eos_token", "</s>")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let Ok(t) = ChatTemplate::from_source(&source, &special, "fuzz.kiln") else {
            return;
        };
        let t = t.isolated(EXE.get().expect("set in init").clone());
        let messages = [
            Message::new("system", "be brief"),
            Message::new("user", message.as_ref()),
        ];
        match t.render(&messages, true) {
            Ok(_) | Err(RunnerError::ChatTemplateLimit { .. }) => {}
            Err(RunnerError::ChatTemplate(e)) => {
                assert!(!e.contains("template renderer"), "the renderer died: {e}");
            }
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }
);
