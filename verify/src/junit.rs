//! JUnit XML results (`--junit FILE`), the format CI systems display as test results.
//!
//! One [`Suite`] per run, inside `<testsuites>`; one [`Case`] per checked item (an activation
//! site, a perplexity chunk or gate, a tensor). A failing case carries a `<failure>` whose
//! `message` gives the measured and the allowed value. Times are seconds; an item that is not
//! timed on its own (one activation of a single forward pass, one tensor of a one-pass scan)
//! has time 0 and its suite carries the run's wall time.

use std::fmt::Write;
use std::path::Path;

use crate::diff::DiffReport;
use crate::error::Result;
use crate::layers::LayersReport;
use crate::perplexity::PerplexityReport;

/// One checked item.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// What was checked (an activation, `chunk 3`, a gate, a tensor).
    pub name: String,
    /// The group CI systems show it under (`kiln-verify.layers`, …).
    pub classname: String,
    /// Seconds spent on this item alone (0 when not timed separately).
    pub time: f64,
    /// `Some(message)` when it failed: the measured and the allowed value.
    pub failure: Option<String>,
    /// The figures measured, shown as the case's output (`<system-out>`).
    pub output: Option<String>,
}

/// One run of one command.
#[derive(Debug, Clone, PartialEq)]
pub struct Suite {
    /// The command and its subject (`layers model.kiln vs 0.safetensors`).
    pub name: String,
    /// Wall time of the whole run, in seconds.
    pub time: f64,
    /// Its cases, in the order checked.
    pub cases: Vec<Case>,
}

impl Suite {
    /// Number of failing cases.
    pub fn failures(&self) -> usize {
        self.cases.iter().filter(|c| c.failure.is_some()).count()
    }
}

/// Escape text for an XML attribute value or element content.
pub fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            // Line breaks inside an attribute are kept as characters, not normalised away.
            '\n' => o.push_str("&#10;"),
            '\r' => o.push_str("&#13;"),
            '\t' => o.push_str("&#9;"),
            // XML 1.0 cannot carry other control characters at all, even escaped.
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => o.push('\u{FFFD}'),
            c => o.push(c),
        }
    }
    o
}

/// The XML document for `suites`.
pub fn render(suites: &[Suite]) -> String {
    let tests: usize = suites.iter().map(|s| s.cases.len()).sum();
    let failures: usize = suites.iter().map(Suite::failures).sum();
    let time: f64 = suites.iter().map(|s| s.time).sum();
    let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        x,
        "<testsuites name=\"kiln-verify\" tests=\"{tests}\" failures=\"{failures}\" errors=\"0\" time=\"{time:.3}\">"
    );
    for s in suites {
        let _ = writeln!(
            x,
            "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{}\" errors=\"0\" skipped=\"0\" time=\"{:.3}\">",
            escape(&s.name),
            s.cases.len(),
            s.failures(),
            s.time
        );
        for c in &s.cases {
            let head = format!(
                "    <testcase name=\"{}\" classname=\"{}\" time=\"{:.3}\"",
                escape(&c.name),
                escape(&c.classname),
                c.time
            );
            if c.failure.is_none() && c.output.is_none() {
                let _ = writeln!(x, "{head}/>");
                continue;
            }
            let _ = writeln!(x, "{head}>");
            if let Some(m) = &c.failure {
                let _ = writeln!(
                    x,
                    "      <failure message=\"{}\" type=\"out of tolerance\">{}</failure>",
                    escape(m),
                    escape(m)
                );
            }
            if let Some(o) = &c.output {
                let _ = writeln!(x, "      <system-out>{}</system-out>", escape(o));
            }
            x.push_str("    </testcase>\n");
        }
        x.push_str("  </testsuite>\n");
    }
    x.push_str("</testsuites>\n");
    x
}

/// Write `suites` to `path` atomically, replacing an earlier results file.
pub fn write(path: &Path, suites: &[Suite]) -> Result<()> {
    kiln_format::write_file_atomic(path, render(suites).as_bytes(), true)?;
    Ok(())
}

/// `a > b`, or either is NaN: a value that does not pass a `≤` limit.
fn over(a: f64, b: f64) -> bool {
    matches!(a.partial_cmp(&b), Some(std::cmp::Ordering::Greater) | None)
}

/// `kiln-verify layers`: one case per compared activation site.
pub fn layers_suite(r: &LayersReport, seconds: f64) -> Suite {
    let t = &r.tolerance;
    let cases = r
        .entries
        .iter()
        .map(|e| {
            let mut why = Vec::new();
            if !e.pass {
                if over(e.nmse, t.max_nmse) {
                    why.push(format!(
                        "NMSE {:.6e} is over the allowed {:e}",
                        e.nmse, t.max_nmse
                    ));
                }
                if let Some(top) = e.top1.filter(|&v| over(t.min_top1, v)) {
                    why.push(format!(
                        "top-1 agreement {top:.4} is under the allowed {}",
                        t.min_top1
                    ));
                }
            }
            Case {
                name: e.name.clone(),
                classname: "kiln-verify.layers".into(),
                time: 0.0,
                failure: (!e.pass)
                    .then(|| format!("{} (cosine {:.9}): {}", e.name, e.cosine, why.join("; "))),
                output: Some(format!(
                    "NMSE {:.6e} (allowed {:e}), cosine {:.9}, max_abs {:.6e}{}",
                    e.nmse,
                    t.max_nmse,
                    e.cosine,
                    e.max_abs,
                    e.top1
                        .map(|v| format!(", top-1 {v:.4} (allowed {})", t.min_top1))
                        .unwrap_or_default()
                )),
            }
        })
        .collect();
    Suite {
        name: format!("layers {} vs {}", r.model, r.reference),
        time: seconds,
        cases,
    }
}

/// `kiln-verify perplexity`: one case per chunk (failing only when not a number) and one per
/// gate.
pub fn perplexity_suite(r: &PerplexityReport, seconds: f64) -> Suite {
    let mut cases: Vec<Case> = r
        .per_chunk
        .iter()
        .enumerate()
        .map(|(i, c)| Case {
            name: format!("chunk {i}"),
            classname: "kiln-verify.perplexity.chunks".into(),
            time: c.seconds,
            failure: (!c.ppl.is_finite())
                .then(|| format!("chunk {i}: perplexity is {}, not a finite number", c.ppl)),
            output: Some(match c.kld_mean {
                Some(k) => format!("perplexity {:.4}, mean KL-divergence {k:.6}", c.ppl),
                None => format!("perplexity {:.4}", c.ppl),
            }),
        })
        .collect();
    cases.extend(r.gates.iter().map(|g| Case {
        name: g.name.to_string(),
        classname: "kiln-verify.perplexity.gates".into(),
        time: 0.0,
        failure: (!g.pass).then(|| g.describe()),
        output: Some(g.describe()),
    }));
    Suite {
        name: format!("perplexity {} on {} (-c {})", r.model, r.text, r.ctx),
        time: seconds,
        cases,
    }
}

/// `kiln-verify integrity`: one case per tensor; `problems` pairs a tensor name with what is
/// wrong with it (a checksum mismatch, non-finite values).
pub fn integrity_suite(
    file: &str,
    tensors: &[String],
    problems: &[(String, String)],
    seconds: f64,
) -> Suite {
    Suite {
        name: format!("integrity {file}"),
        time: seconds,
        cases: tensors
            .iter()
            .map(|t| Case {
                name: t.clone(),
                classname: "kiln-verify.integrity".into(),
                time: 0.0,
                failure: {
                    let why: Vec<&str> = problems
                        .iter()
                        .filter(|(n, _)| n == t)
                        .map(|(_, why)| why.as_str())
                        .collect();
                    (!why.is_empty()).then(|| why.join("; "))
                },
                output: None,
            })
            .collect(),
    }
}

/// `kiln-verify diff`: one case per shared tensor, failing where either file's data does not
/// match its checksum (the figures are informative, there is no limit on them).
pub fn diff_suite(r: &DiffReport, seconds: f64) -> Suite {
    let failure_of = |name: &str| {
        let msgs: Vec<String> = r
            .checksum_failures
            .iter()
            .filter(|f| f.tensor == name)
            .map(|f| {
                format!(
                    "{}: checksum mismatch (stored {}, computed {})",
                    f.file, f.stored, f.computed
                )
            })
            .collect();
        (!msgs.is_empty()).then(|| msgs.join("; "))
    };
    let mut cases: Vec<Case> = r
        .rows
        .iter()
        .map(|x| Case {
            name: x.name.clone(),
            classname: "kiln-verify.diff".into(),
            time: 0.0,
            failure: failure_of(&x.name),
            output: Some(format!(
                "{} -> {}: rmse {:.6e}, max_abs {:.6e}, snr {:.2} dB, cosine {:.9}",
                x.dtype_a, x.dtype_b, x.rmse, x.max_abs, x.snr_db, x.cosine
            )),
        })
        .collect();
    // A corrupt tensor that only one file has still fails the run: give it a case too.
    let mut extra: Vec<&str> = r
        .checksum_failures
        .iter()
        .map(|f| f.tensor.as_str())
        .filter(|t| !r.rows.iter().any(|x| x.name == *t))
        .collect();
    extra.dedup();
    cases.extend(extra.into_iter().map(|t| Case {
        name: t.to_string(),
        classname: "kiln-verify.diff".into(),
        time: 0.0,
        failure: failure_of(t),
        output: None,
    }));
    Suite {
        name: format!("diff {} vs {}", r.a, r.b),
        time: seconds,
        cases,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(name: &str, failure: Option<&str>) -> Case {
        Case {
            name: name.into(),
            classname: "k".into(),
            time: 0.25,
            failure: failure.map(String::from),
            output: None,
        }
    }

    #[test]
    fn escaping_covers_markup_quotes_and_control_characters() {
        let table = [
            ("a<b>&c", "a&lt;b&gt;&amp;c"),
            ("say \"x\" 'y'", "say &quot;x&quot; &apos;y&apos;"),
            ("line\nnext\ttab", "line&#10;next&#9;tab"),
            ("bell\u{7}", "bell\u{FFFD}"),
            ("≤ 1e-8", "≤ 1e-8"),
        ];
        for (raw, want) in table {
            assert_eq!(escape(raw), want, "{raw:?}");
        }
    }

    #[test]
    fn counts_match_the_cases_and_failures_are_escaped() {
        let suites = [
            Suite {
                name: "layers a&b".into(),
                time: 1.5,
                cases: vec![
                    case("model.layers.0.output", None),
                    case("model.layers.1.output", Some("NMSE 2 > 1 <bad>")),
                    case("logits", Some("top-1 \"0.5\"")),
                ],
            },
            Suite {
                name: "integrity".into(),
                time: 0.5,
                cases: vec![case("t", None)],
            },
        ];
        let x = render(&suites);
        assert!(x.starts_with("<?xml"));
        assert!(x.contains(
            "<testsuites name=\"kiln-verify\" tests=\"4\" failures=\"2\" errors=\"0\" time=\"2.000\">"
        ));
        assert!(x.contains("<testsuite name=\"layers a&amp;b\" tests=\"3\" failures=\"2\""));
        assert!(x.contains("<testsuite name=\"integrity\" tests=\"1\" failures=\"0\""));
        assert_eq!(x.matches("<testcase ").count(), 4);
        assert_eq!(x.matches("<failure ").count(), 2);
        assert!(x.contains("message=\"NMSE 2 &gt; 1 &lt;bad&gt;\""));
        assert!(x.contains("message=\"top-1 &quot;0.5&quot;\""));
        assert!(x.contains("time=\"0.250\""));
        // Every opened element is closed, in order.
        assert_eq!(
            x.matches("<testsuite ").count(),
            x.matches("</testsuite>").count()
        );
        assert_eq!(
            x.matches("<testcase ").count() - x.matches("/>").count(),
            x.matches("</testcase>").count()
        );
        assert!(x.trim_end().ends_with("</testsuites>"));
    }
}
