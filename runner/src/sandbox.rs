//! Rendering an untrusted chat template in a child process with memory and CPU limits.
//!
//! A chat template is code from a downloaded model. [`crate::chat`] bounds what minijinja can
//! bound (instructions, output size, recursion), but not the memory of the values a template
//! builds: `{% set ns.s = ns.s ~ ns.s %}` forty times asks for a terabyte in forty
//! instructions, and Rust answers a failed allocation by aborting the process. So `kiln-run`
//! renders in a copy of itself (the same executable, started with [`CHILD_ARG`]) that lowers
//! its own address-space and CPU-time limits before rendering. Whatever the template does,
//! the child either answers or dies, and the parent turns a death into
//! [`RunnerError::ChatTemplateLimit`] naming the model file.
//!
//! The cost is one process start per rendering (a few milliseconds, once per chat turn).
//! Library callers that render trusted templates keep the in-process path.
//!
//! The exchange is one JSON request on the child's stdin (`Request`) and one JSON reply on
//! its stdout (`Reply`).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};

use minijinja::Value;
use serde::{Deserialize, Serialize};

use crate::chat::{ChatTemplate, Message, TemplateVars};
use crate::error::{Result, RunnerError};

/// First argument that makes `kiln-run` serve one rendering instead of parsing a command line.
pub const CHILD_ARG: &str = "__kiln-render-chat-template";

/// Address space the rendering child may use. Real templates need a few MB on top of the
/// executable itself; a rendered prompt is at most 16 MiB ([`crate::chat::TEMPLATE_MAX_OUTPUT`]).
pub const TEMPLATE_MAX_MEMORY: u64 = 1 << 30;

/// CPU seconds the rendering child may use; fuel stops loops long before this, so it only
/// catches single instructions that are expensive (sorting or joining huge values).
pub const TEMPLATE_MAX_CPU_SECONDS: u64 = 20;

#[derive(Serialize, Deserialize)]
struct Request {
    source: String,
    special: Vec<(String, String)>,
    label: String,
    /// Template variables as (name, JSON text).
    vars: Vec<(String, String)>,
    messages: Vec<(String, String)>,
    add_generation_prompt: bool,
}

#[derive(Serialize, Deserialize)]
enum Reply {
    Rendered(String),
    Limit(String),
    Error(String),
}

/// Render in a child started from `exe`, which must call [`serve_if_child`] first thing.
pub(crate) fn render_in_child(
    exe: &Path,
    source: &str,
    special: &Value,
    label: &str,
    vars: &TemplateVars,
    messages: &[Message],
    add_generation_prompt: bool,
) -> Result<String> {
    let failed = |reason: String| RunnerError::ChatTemplate(format!("{label}: {reason}"));
    let request = Request {
        source: source.to_string(),
        special: string_pairs(special),
        label: label.to_string(),
        vars: vars
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect(),
        messages: messages
            .iter()
            .map(|m| (m.role.clone(), m.content.clone()))
            .collect(),
        add_generation_prompt,
    };
    let request = serde_json::to_vec(&request).map_err(|e| failed(e.to_string()))?;
    let mut child = Command::new(exe)
        .arg(CHILD_ARG)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            failed(format!(
                "cannot start the template renderer {}: {e}",
                exe.display()
            ))
        })?;
    // The child reads its whole request before it writes anything, so writing first and
    // reading after cannot deadlock.
    if let Some(mut stdin) = child.stdin.take() {
        // A child that died early closes the pipe; its exit status below says why.
        let _ = stdin.write_all(&request);
    }
    let out = child
        .wait_with_output()
        .map_err(|e| failed(format!("template renderer: {e}")))?;
    if out.status.success() {
        return match serde_json::from_slice(&out.stdout) {
            Ok(Reply::Rendered(s)) => Ok(s),
            Ok(Reply::Limit(reason)) => Err(RunnerError::ChatTemplateLimit {
                file: label.to_string(),
                reason,
            }),
            Ok(Reply::Error(e)) => Err(RunnerError::ChatTemplate(e)),
            Err(e) => Err(failed(format!("template renderer replied badly: {e}"))),
        };
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let reason = if stderr.contains("memory allocation") {
        format!("more than {} MiB of memory", TEMPLATE_MAX_MEMORY >> 20)
    } else if killed_for_cpu(&out.status) {
        format!("more than {TEMPLATE_MAX_CPU_SECONDS} s of CPU time")
    } else {
        let last = stderr.lines().last().unwrap_or("").trim();
        return Err(failed(format!(
            "the template renderer stopped ({}){}{last}",
            out.status,
            if last.is_empty() { "" } else { ": " }
        )));
    };
    Err(RunnerError::ChatTemplateLimit {
        file: label.to_string(),
        reason,
    })
}

/// The string-valued entries of a map value (the special tokens: `bos_token` → `<s>`…).
fn string_pairs(map: &Value) -> Vec<(String, String)> {
    let Ok(keys) = map.try_iter() else {
        return Vec::new();
    };
    keys.filter_map(|k| {
        let v = map.get_item(&k).ok()?;
        Some((k.as_str()?.to_string(), v.as_str()?.to_string()))
    })
    .collect()
}

#[cfg(unix)]
fn killed_for_cpu(status: &std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    // SIGXCPU at the soft limit, SIGKILL at the hard one.
    matches!(status.signal(), Some(24) | Some(9))
}

#[cfg(not(unix))]
fn killed_for_cpu(_: &std::process::ExitStatus) -> bool {
    false
}

/// When this process was started as a rendering child ([`CHILD_ARG`]), serve the one request
/// on stdin and return the exit code; otherwise `None`. `kiln-run` calls this before parsing
/// its command line.
pub fn serve_if_child() -> Option<ExitCode> {
    if std::env::args_os().nth(1).as_deref() != Some(std::ffi::OsStr::new(CHILD_ARG)) {
        return None;
    }
    Some(match serve() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln-run: template renderer: {e}");
            ExitCode::from(2)
        }
    })
}

fn serve() -> std::io::Result<()> {
    let mut input = Vec::new();
    std::io::stdin().read_to_end(&mut input)?;
    limit_resources()?;
    let req: Request = serde_json::from_slice(&input)?;
    let messages: Vec<Message> = req
        .messages
        .iter()
        .map(|(role, content)| Message::new(role, content.as_str()))
        .collect();
    let mut vars = TemplateVars::new();
    let reply = match req
        .vars
        .iter()
        .try_for_each(|(n, v)| vars.set_json(n, v))
        .and_then(|()| {
            ChatTemplate::with_label(
                &req.source,
                Value::from_pairs(req.special.iter().map(|(k, v)| (k.as_str(), v.as_str()))),
                &req.label,
            )
        })
        .and_then(|t| {
            t.with_vars(vars)
                .render(&messages, req.add_generation_prompt)
        }) {
        Ok(s) => Reply::Rendered(s),
        Err(RunnerError::ChatTemplateLimit { reason, .. }) => Reply::Limit(reason),
        Err(e) => Reply::Error(match e {
            RunnerError::ChatTemplate(s) => s,
            other => other.to_string(),
        }),
    };
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, &reply)?;
    out.flush()
}

/// Lower this process's address-space and CPU-time limits (Linux); elsewhere the child still
/// keeps a crash out of the parent, without the limits.
#[cfg(target_os = "linux")]
fn limit_resources() -> std::io::Result<()> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lower = |resource: Resource, soft: u64, hard: u64| -> std::io::Result<()> {
        let cur = getrlimit(resource);
        let cap = |want: u64, have: Option<u64>| Some(have.map_or(want, |h| h.min(want)));
        setrlimit(
            resource,
            Rlimit {
                current: cap(soft, cur.current),
                maximum: cap(hard, cur.maximum),
            },
        )
        .map_err(std::io::Error::from)
    };
    lower(Resource::As, TEMPLATE_MAX_MEMORY, TEMPLATE_MAX_MEMORY)?;
    lower(
        Resource::Cpu,
        TEMPLATE_MAX_CPU_SECONDS,
        TEMPLATE_MAX_CPU_SECONDS + 1,
    )
}

#[cfg(not(target_os = "linux"))]
fn limit_resources() -> std::io::Result<()> {
    Ok(())
}
