//! The model's chat template, rendered with `minijinja` the way transformers'
//! `apply_chat_template` renders it with Jinja2.
//!
//! Same environment settings (`trim_blocks`, `lstrip_blocks`), the same globals
//! (`raise_exception`, `strftime_now`, the special-token strings, `add_generation_prompt`) and
//! Python string methods (`.strip()`, `.startswith()`…) through `minijinja-contrib`'s pycompat.
//! A template's own default system prompt applies unless the messages start with one.
//! [`TemplateVars`] are the variables a template reads beyond the conversation
//! (`enable_thinking`, `tools`…), which transformers passes as `apply_chat_template(**kwargs)`.

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

use kiln_format::KilnFile;

use crate::error::{Result, RunnerError};

/// One conversation turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message with `role`.
    pub fn new(role: &str, content: impl Into<String>) -> Message {
        Message {
            role: role.to_string(),
            content: content.into(),
        }
    }
}

/// Most bytes of JSON all template variables together may hold. They come from the command
/// line (a few bytes to a few KiB of tool schemas) but are rendered by an untrusted template,
/// which may copy them many times over; 1 MiB keeps that within the output cap.
pub const TEMPLATE_VARS_MAX_BYTES: usize = 1 << 20;

/// Names the renderer sets itself and a variable may not: the conversation and the generation
/// prompt (transformers refuses a `messages` keyword argument, "got multiple values", and
/// `add_generation_prompt` is its own parameter), and the two functions the environment
/// provides (a Jinja2 keyword argument would shadow the function, which only breaks the
/// template). The special tokens (`bos_token`…) are not here: transformers lets keyword
/// arguments override them (`{**special_tokens_map, **kwargs}`), and so does Kiln.
pub const RESERVED_TEMPLATE_VARS: [&str; 4] = [
    "messages",
    "add_generation_prompt",
    "raise_exception",
    "strftime_now",
];

/// Variables a chat template reads beyond the conversation, such as Qwen3's `enable_thinking`
/// or a `tools` list: what transformers' `apply_chat_template(..., **kwargs)` and llama.cpp's
/// `--chat-template-kwargs` pass. Each value is JSON (kept as text, so that objects keep their
/// key order as Python's dicts do); a name set twice keeps the last value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateVars {
    vars: Vec<(String, String)>,
}

impl TemplateVars {
    /// No variables.
    pub fn new() -> TemplateVars {
        TemplateVars::default()
    }

    /// Whether no variable is set.
    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }

    /// The variables as (name, JSON text) pairs, in the order they were first set.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.vars.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }

    /// Set `name` to the JSON value `json` (`false`, `3`, `"x"`, `[{"type": "function"}]`).
    pub fn set_json(&mut self, name: &str, json: &str) -> Result<()> {
        let err = |reason: String| RunnerError::TemplateVar {
            name: name.to_string(),
            reason,
        };
        let identifier = name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !identifier {
            return Err(err(
                "a name is an identifier: letters, digits and `_`, not starting with a digit"
                    .into(),
            ));
        }
        if RESERVED_TEMPLATE_VARS.contains(&name) {
            return Err(err(
                "the renderer sets this one itself (reserved: messages, add_generation_prompt, \
                 raise_exception, strftime_now)"
                    .into(),
            ));
        }
        // Parsed into minijinja's value, whose maps keep their key order (serde_json's sort
        // theirs), and kept as compact text.
        let parsed: Value =
            serde_json::from_str(json).map_err(|e| err(format!("not JSON: {e}")))?;
        let text = serde_json::to_string(&parsed).map_err(|e| err(e.to_string()))?;
        let others: usize = self
            .vars
            .iter()
            .filter(|(n, _)| n != name)
            .map(|(n, v)| n.len() + v.len())
            .sum();
        if others + name.len() + text.len() > TEMPLATE_VARS_MAX_BYTES {
            return Err(err(format!(
                "the variables together exceed {TEMPLATE_VARS_MAX_BYTES} bytes"
            )));
        }
        match self.vars.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => *v = text,
            None => self.vars.push((name.to_string(), text)),
        }
        Ok(())
    }

    /// Set a variable from `NAME=VALUE`, as `kiln-run --template-var` takes it: VALUE is JSON
    /// when it parses as JSON (`false`, `3`, `"x"`, `[1, 2]`, `{"a": 1}`, `null`), else the
    /// string itself. Python's `True`, `False` and `None` are refused with the JSON spelling,
    /// since taken as strings they would be truthy (`enable_thinking=False` would enable it).
    pub fn set_assignment(&mut self, arg: &str) -> Result<()> {
        let Some((name, value)) = arg.split_once('=') else {
            return Err(RunnerError::TemplateVar {
                name: arg.to_string(),
                reason: "expected NAME=VALUE".into(),
            });
        };
        if let Some(json) = match value {
            "True" => Some("true"),
            "False" => Some("false"),
            "None" => Some("null"),
            _ => None,
        } {
            return Err(RunnerError::TemplateVar {
                name: name.to_string(),
                reason: format!(
                    "`{value}` is Python; write JSON `{json}` (or `\"{value}\"` for the string)"
                ),
            });
        }
        if serde_json::from_str::<serde::de::IgnoredAny>(value).is_ok() {
            self.set_json(name, value)
        } else {
            let quoted = serde_json::to_string(value).expect("a string serialises");
            self.set_json(name, &quoted)
        }
    }

    /// The values, parsed for minijinja (objects keep their key order).
    fn values(&self) -> Result<Vec<(String, Value)>> {
        self.vars
            .iter()
            .map(|(n, v)| {
                let value: Value =
                    serde_json::from_str(v).map_err(|e| RunnerError::TemplateVar {
                        name: n.clone(),
                        reason: format!("not JSON: {e}"),
                    })?;
                Ok((n.clone(), value))
            })
            .collect()
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate<'a> {
    env: Environment<'a>,
    source: &'a str,
    special: Value,
    /// Variables beyond the conversation ([`TemplateVars`]).
    vars: TemplateVars,
    /// What the template came from (the model file), for error messages.
    label: String,
    /// Render in a child process started from this executable ([`crate::sandbox`]).
    isolated: Option<std::path::PathBuf>,
}

const NAME: &str = "chat_template";

/// Most template instructions one rendering may execute. A template comes from a downloaded
/// model and is untrusted: nested loops over `range(10**6)` would otherwise run until killed.
/// Real templates spend a few hundred instructions per message (SmolLM2's: ~40), so this
/// allows conversations far longer than any context, and stops a hostile one in about a second.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// Most bytes one rendering may produce. A rendered prompt must then fit the context, so 16 MiB
/// is far past any real one (4096 tokens of text are ~16 KiB), and a template that builds a
/// huge string stops with an error instead of exhausting memory.
pub const TEMPLATE_MAX_OUTPUT: usize = 16 << 20;

/// Deepest nesting of template calls, includes and macros (minijinja's default is 500).
const TEMPLATE_RECURSION_LIMIT: usize = 100;

impl<'a> ChatTemplate<'a> {
    /// The file's template, or [`RunnerError::NoChatTemplate`].
    pub fn from_file(file: &'a KilnFile) -> Result<ChatTemplate<'a>> {
        let meta = file.metadata();
        let source =
            meta.tokenizer
                .chat_template
                .as_deref()
                .ok_or_else(|| RunnerError::NoChatTemplate {
                    file: file.label().to_string(),
                })?;
        Self::from_source(source, &meta.tokenizer.special_tokens, file.label())
    }

    /// Compile a model's template `source` with its special tokens (`bos_token` → `<s>`…),
    /// naming `label` (the model file) in errors.
    pub fn from_source(
        source: &'a str,
        special_tokens: &std::collections::BTreeMap<String, String>,
        label: &str,
    ) -> Result<ChatTemplate<'a>> {
        let special = Value::from_pairs(special_tokens.iter().map(|(k, v)| (k.clone(), v.clone())));
        Self::with_label(source, special, label)
    }

    /// Compile `source`; `special` maps `bos_token`, `eos_token`… to their strings.
    pub fn new(source: &'a str, special: Value) -> Result<ChatTemplate<'a>> {
        Self::with_label(source, special, "chat template")
    }

    /// [`ChatTemplate::new`], naming `label` (the model file) in errors.
    pub fn with_label(source: &'a str, special: Value, label: &str) -> Result<ChatTemplate<'a>> {
        let mut env = Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION_LIMIT);
        // transformers: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| RunnerError::ChatTemplate(describe(&e)))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template(NAME, source)
            .map_err(|e| RunnerError::ChatTemplate(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            source,
            special,
            vars: TemplateVars::new(),
            label: label.to_string(),
            isolated: None,
        })
    }

    /// Render with `vars` set (each overriding a special token of the same name, as
    /// transformers' keyword arguments do).
    pub fn with_vars(mut self, vars: TemplateVars) -> ChatTemplate<'a> {
        self.vars = vars;
        self
    }

    /// Render in a child process started from `exe` (which calls
    /// [`crate::sandbox::serve_if_child`] first), under memory and CPU limits: what `kiln-run`
    /// does with a model's template, which is untrusted. The template is already compiled
    /// here, so a syntax error is still reported at once.
    pub fn isolated(mut self, exe: std::path::PathBuf) -> ChatTemplate<'a> {
        self.isolated = Some(exe);
        self
    }

    /// Render `messages`, ending with the assistant prompt when `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        if let Some(exe) = &self.isolated {
            return crate::sandbox::render_in_child(
                exe,
                self.source,
                &self.special,
                &self.label,
                &self.vars,
                messages,
                add_generation_prompt,
            );
        }
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| RunnerError::ChatTemplate(describe(&e)))?;
        let s = &self.special;
        let get = |k: &str| s.get_attr(k).unwrap_or(Value::UNDEFINED);
        let messages: Value = messages
            .iter()
            .map(|m| {
                Value::from_pairs([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        let mut out = CappedWriter {
            buf: Vec::new(),
            cap: TEMPLATE_MAX_OUTPUT,
            overflowed: false,
        };
        // The special tokens, then the variables (which may override them), then what the
        // renderer sets itself (which no variable may name).
        let mut ctx: Vec<(String, Value)> = ["bos_token", "eos_token", "pad_token", "unk_token"]
            .iter()
            .map(|k| (k.to_string(), get(k)))
            .collect();
        for (name, value) in self.vars.values()? {
            ctx.retain(|(k, _)| *k != name);
            ctx.push((name, value));
        }
        ctx.push(("messages".into(), messages));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let rendered = tmpl.render_captured_to(Value::from_pairs(ctx), &mut out);
        match rendered {
            Ok(_) => String::from_utf8(out.buf)
                .map_err(|_| RunnerError::ChatTemplate("rendered text is not UTF-8".into())),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(RunnerError::ChatTemplateLimit {
                file: self.label.clone(),
                reason: format!("more than {TEMPLATE_FUEL} instructions"),
            }),
            Err(_) if out.overflowed => Err(RunnerError::ChatTemplateLimit {
                file: self.label.clone(),
                reason: format!("more than {TEMPLATE_MAX_OUTPUT} bytes of output"),
            }),
            Err(e) => Err(RunnerError::ChatTemplate(describe(&e))),
        }
    }
}

/// A sink that refuses to grow past `cap` bytes, so rendering stops at the cap.
struct CappedWriter {
    buf: Vec<u8>,
    cap: usize,
    overflowed: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(b.len()) > self.cap {
            self.overflowed = true;
            return Err(std::io::Error::other("output limit reached"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// `raise_exception(msg)`: the template rejects the conversation.
fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)`: the current UTC date/time, with the common C specifiers.
fn strftime_now(format: String) -> std::result::Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(&format, secs).map(Value::from)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
];

/// Format Unix time `secs` (UTC) with `%Y %m %d %e %B %b %A %a %H %M %S %j %y %%`.
fn strftime(format: &str, secs: u64) -> std::result::Result<String, Error> {
    let (y, m, d, rem) = kiln_format::metadata::civil_from_unix(secs);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let day = DAYS[((secs / 86_400) as i64).rem_euclid(7) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(day),
            Some('a') => out.push_str(&day[..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported specifier %{}",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn a_template_that_loops_without_end_runs_out_of_fuel() {
        let src = "{% for i in range(10000) %}{% for j in range(10000) %}{% for k in range(10000) %}{% endfor %}{% endfor %}{% endfor %}";
        let t = ChatTemplate::with_label(src, Value::UNDEFINED, "m.kiln").unwrap();
        let t0 = std::time::Instant::now();
        let e = t.render(&[Message::new("user", "hi")], true).unwrap_err();
        assert!(
            matches!(&e, RunnerError::ChatTemplateLimit { file, reason } if file == "m.kiln" && reason.contains("instructions")),
            "{e}"
        );
        assert!(t0.elapsed().as_secs() < 30, "stopped by fuel, not by time");
    }

    #[test]
    fn a_template_that_builds_a_huge_output_stops_at_the_cap() {
        // Each line is 10 MB (minijinja caps one repetition at 100 MB); twenty of them would be
        // 200 MB of prompt.
        let src = "{% for i in range(20) %}{{ 'x' * 10000000 }}{% endfor %}";
        let t = ChatTemplate::with_label(src, Value::UNDEFINED, "m.kiln").unwrap();
        let e = t.render(&[Message::new("user", "hi")], true).unwrap_err();
        assert!(
            matches!(&e, RunnerError::ChatTemplateLimit { reason, .. } if reason.contains("bytes")),
            "{e}"
        );
    }

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let t = ChatTemplate::new(CHATML, Value::UNDEFINED).unwrap();
        let s = t
            .render(&[Message::new("user", "What is 7 * 6?")], true)
            .unwrap();
        assert_eq!(
            s,
            "<|im_start|>user\nWhat is 7 * 6?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_raise_exception_and_special_tokens() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}{{ m.content.strip().upper() }}{% endfor %}";
        let special = Value::from_pairs([("bos_token", "<s>")]);
        let t = ChatTemplate::new(src, special).unwrap();
        assert_eq!(
            t.render(&[Message::new("user", "  hi ")], false).unwrap(),
            "<s>HI"
        );
        let e = t.render(&[Message::new("tool", "x")], false).unwrap_err();
        assert!(e.to_string().contains("bad role tool"), "{e}");
    }

    #[test]
    fn qwen_and_llama3_idioms_render() {
        // Qwen2.5: tojson behind an undefined `tools`; Llama 3.1: strftime_now, namespace, trim.
        let src = "{%- if tools %}{{ tools | tojson }}{% endif -%}\n{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- set ns.n = ns.n + 1 %}{{ m['content'] | trim }}{% endfor %}|{{ ns.n }}|{{ strftime_now('%Y') | length }}|{{ messages | tojson }}";
        let t = ChatTemplate::new(src, Value::UNDEFINED).unwrap();
        let out = t.render(&[Message::new("user", " a ")], true).unwrap();
        assert!(out.starts_with("a|1|4|["), "{out}");
        assert!(out.contains("\"content\""), "{out}");
    }

    fn vars(args: &[&str]) -> Result<TemplateVars> {
        let mut v = TemplateVars::new();
        for a in args {
            v.set_assignment(a)?;
        }
        Ok(v)
    }

    #[test]
    fn template_vars_are_json_when_they_parse_else_strings() {
        let v = vars(&[
            "enable_thinking=false",
            "n=3",
            "s=\"x\"",
            "word=hello world",
            "list=[1, \"a\"]",
            "empty=",
            "n=4",
        ])
        .unwrap();
        let got: Vec<(&str, &str)> = v.iter().collect();
        assert_eq!(
            got,
            [
                ("enable_thinking", "false"),
                ("n", "4"),
                ("s", "\"x\""),
                ("word", "\"hello world\""),
                ("list", "[1,\"a\"]"),
                ("empty", "\"\""),
            ],
            "the last value of a name wins, in its first place"
        );
    }

    #[test]
    fn template_vars_refuse_bad_names_reserved_names_and_python_literals() {
        for (arg, name, says) in [
            ("noequals", "noequals", "NAME=VALUE"),
            ("2x=1", "2x", "identifier"),
            ("a-b=1", "a-b", "identifier"),
            ("=1", "", "identifier"),
            ("messages=[]", "messages", "sets this one itself"),
            (
                "add_generation_prompt=true",
                "add_generation_prompt",
                "itself",
            ),
            ("raise_exception=1", "raise_exception", "itself"),
            ("enable_thinking=False", "enable_thinking", "JSON `false`"),
            ("x=None", "x", "JSON `null`"),
        ] {
            let e = vars(&[arg]).unwrap_err();
            assert!(
                matches!(&e, RunnerError::TemplateVar { name: n, reason } if n == name && reason.contains(says)),
                "{arg}: {e}"
            );
        }
        let e = TemplateVars::new().set_json("x", "{oops").unwrap_err();
        assert!(e.to_string().contains("not JSON"), "{e}");
    }

    #[test]
    fn template_vars_are_capped_in_size() {
        let mut v = TemplateVars::new();
        let big = "a".repeat(TEMPLATE_VARS_MAX_BYTES / 2);
        v.set_assignment(&format!("a={big}")).unwrap();
        let e = v.set_assignment(&format!("b={big}")).unwrap_err();
        assert!(e.to_string().contains("exceed"), "{e}");
        // Replacing a value counts the new one only.
        v.set_assignment(&format!("a={big}")).unwrap();
    }

    #[test]
    fn template_vars_render_in_key_order_and_override_special_tokens() {
        let src = "{{ bos_token }}|{{ tools | tojson }}|{% if enable_thinking is false %}off{% endif %}|{{ messages | tojson }}";
        let special = Value::from_pairs([("bos_token", "<s>")]);
        let t = ChatTemplate::new(src, special).unwrap().with_vars(
            vars(&[
                "tools=[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]",
                "enable_thinking=false",
                "bos_token=",
            ])
            .unwrap(),
        );
        assert_eq!(
            t.render(&[Message::new("user", "hi")], true).unwrap(),
            "|[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]|off|[{\"role\": \"user\", \"content\": \"hi\"}]",
            "keys in the order given (Python's dicts), messages as role then content"
        );
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208.
        let t = 1_722_000_000 + 309;
        assert_eq!(
            strftime("%d %b %Y|%B %e|%A %a|%H:%M:%S|%j|%%", t).unwrap(),
            "26 Jul 2024|July 26|Friday Fri|13:25:09|208|%"
        );
        assert!(strftime("%Q", 0).is_err());
    }
}
