//! Refusals that name what is wrong: a metadata field serde cannot read is named by its path
//! (not as the whole document at some column), a RoPE factor beyond an f32 says so in a short
//! message (not as 309 digits), and a socket given as an input is called a socket. Each runs
//! the real `kiln-convert` and expects exit status 2.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{convert, repo, with_metadata};

fn kiln_convert(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln-convert"))
        .args(args)
        .output()
        .unwrap()
}

/// Expect exit status 2 and every needle in the message; returns the message.
#[track_caller]
fn expect_refusal(r: &Output, needles: &[&str]) -> String {
    let err = String::from_utf8_lossy(&r.stderr).into_owned();
    assert_eq!(r.status.code(), Some(2), "{err}");
    for n in needles {
        assert!(err.contains(n), "{n:?} not in {err:?}");
    }
    err
}

/// Regression: a `.kiln` embedding model whose second Dense module has an activation Kiln does
/// not know was blamed on "metadata field `(document)`: … at line 1 column 972".
#[test]
fn an_unknown_dense_activation_in_a_kiln_file_is_named_by_its_field() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good.kiln");
    convert(
        &repo().join("fixtures/embedding/embedding-gemma-f32"),
        &good,
    );
    let bytes = with_metadata(&std::fs::read(&good).unwrap(), |m| {
        m["config"]["embedding"]["dense"][1]["activation"] = "relu".into();
    });
    let bad = tmp.path().join("bad.kiln");
    std::fs::write(&bad, bytes).unwrap();
    let r = kiln_convert(&["inspect".as_ref(), bad.as_os_str()]);
    let err = expect_refusal(
        &r,
        &[
            "bad.kiln",
            "metadata field `config.embedding.dense[1].activation`",
            "unknown variant `relu`",
            "`identity` or `tanh`",
        ],
    );
    assert!(
        !err.contains("(document)") && !err.contains("column"),
        "{err}"
    );
}

/// The converter's own reading of a Dense module's `activation_function` names the key and the
/// module's file.
#[test]
fn an_unknown_dense_activation_in_a_checkpoint_is_named_by_its_key() {
    let tmp = tempfile::tempdir().unwrap();
    let src = repo().join("fixtures/embedding/embedding-gemma-f32");
    let copy = tmp.path().join("model");
    copy_dir(&src, &copy);
    let config = copy.join("3_Dense/config.json");
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    v["activation_function"] = "torch.nn.modules.activation.ReLU".into();
    std::fs::write(&config, v.to_string()).unwrap();
    let out = tmp.path().join("m.kiln");
    let r = kiln_convert(&[
        "hf".as_ref(),
        copy.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
    ]);
    expect_refusal(
        &r,
        &[
            "3_Dense/config.json",
            "activation_function",
            "ReLU",
            "Identity and Tanh",
        ],
    );
    assert!(!out.exists());
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
}

/// Regression: `rope_scaling.factor = 1e308` was refused as "needs factor > 0" with the
/// factor printed as a 309-digit number. It is finite as an f64 but not as the f32 the runner
/// computes with, and the message says that, with the number as `1e308`.
#[test]
fn a_rope_factor_beyond_an_f32_is_refused_in_a_short_message() {
    let tmp = tempfile::tempdir().unwrap();
    for (i, (scaling, field, words)) in [
        (
            serde_json::json!({"rope_theta": 10000.0, "rope_type": "linear", "factor": 1e308}),
            "rope_scaling.factor",
            "1e308 does not fit in an f32",
        ),
        (
            serde_json::json!({"rope_theta": 10000.0, "rope_type": "llama3", "factor": 1e308,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128}),
            "rope_scaling.factor",
            "1e308 does not fit in an f32",
        ),
        (
            serde_json::json!({"rope_theta": 10000.0, "rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1e-300, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128}),
            "rope_scaling.low_freq_factor",
            "1e-300 is too small for an f32 (it rounds to 0)",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let copy = tmp.path().join(format!("model-{i}"));
        copy_dir(&repo().join("fixtures/tiny/llama-tied-f32"), &copy);
        let config = copy.join("config.json");
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
        v["rope_parameters"] = scaling;
        std::fs::write(&config, v.to_string()).unwrap();
        let out = tmp.path().join(format!("m-{i}.kiln"));
        let r = kiln_convert(&[
            "hf".as_ref(),
            copy.as_os_str(),
            "-o".as_ref(),
            out.as_os_str(),
        ]);
        let err = expect_refusal(&r, &[&format!("`{field}`"), words]);
        assert!(!err.contains("0000000000"), "{err}");
        assert!(err.len() < 400, "{} bytes: {err}", err.len());
    }
}

/// Regression: a listening socket given as an input got "No such device or address (os error
/// 6)"; it is called a socket, as FIFOs and devices are called what they are.
#[test]
fn a_socket_given_as_an_input_is_called_a_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("model.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let out = tmp.path().join("x.kiln");
    for (args, expected) in [
        (
            vec!["inspect".as_ref(), sock.as_os_str()],
            "give the path of the .kiln file",
        ),
        (
            vec![
                "gguf".as_ref(),
                sock.as_os_str(),
                "-o".as_ref(),
                out.as_os_str(),
            ],
            "give the path of the GGUF file",
        ),
    ] {
        let r = kiln_convert(&args);
        let err = expect_refusal(&r, &["model.sock: is a socket, not a file", expected]);
        assert!(!err.contains("os error"), "{err}");
    }
    assert!(!out.exists());
}
