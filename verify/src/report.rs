//! Self-contained HTML reports (`--report FILE.html`): the figures of a `layers` or
//! `perplexity` run as inline SVG charts and a table, with no script and no external resource,
//! so the page opens from a CI artifact as it is.

use std::fmt::Write;
use std::path::Path;

use crate::error::Result;
use crate::junit::escape;
use crate::layers::LayersReport;
use crate::perplexity::PerplexityReport;

/// Chart size in SVG user units, and the margin left for the axis labels.
const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 260.0;
const MARGIN: f64 = 60.0;

/// NMSE below this is drawn at this value (an exact match has NMSE 0, which log scale cannot
/// place).
const NMSE_FLOOR: f64 = 1e-20;

/// Bars in the KL-divergence histogram.
const HISTOGRAM_BINS: usize = 40;

const STYLE: &str = "body{font-family:sans-serif;margin:2em;color:#222}\
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;\
text-align:right}td:first-child{text-align:left}tr.fail{background:#fdd}\
svg{border:1px solid #ddd;background:#fff}.pass{color:#070}.failed{color:#b00}";

/// Write `html` to `path` atomically, replacing an earlier report.
pub fn write(path: &Path, html: &str) -> Result<()> {
    kiln_format::write_file_atomic(path, html.as_bytes(), true)?;
    Ok(())
}

fn page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\
         <style>{STYLE}</style></head><body>\n{body}</body></html>\n",
        escape(title)
    )
}

/// A chart frame: x from 0 to `n - 1` (one slot per point), y over `[lo, hi]`.
struct Frame {
    n: usize,
    lo: f64,
    hi: f64,
}

impl Frame {
    fn x(&self, i: usize) -> f64 {
        let span = (self.n.max(2) - 1) as f64;
        MARGIN + (WIDTH - 2.0 * MARGIN) * i as f64 / span
    }

    fn y(&self, v: f64) -> f64 {
        let t = if self.hi > self.lo {
            ((v - self.lo) / (self.hi - self.lo)).clamp(0.0, 1.0)
        } else {
            0.5
        };
        HEIGHT - MARGIN / 2.0 - (HEIGHT - MARGIN) * t
    }

    /// The SVG's opening, title, axes and y labels (`label` formats a y value).
    fn open(&self, title: &str, label: impl Fn(f64) -> String) -> String {
        let mut s = format!(
            "<svg width=\"{WIDTH}\" height=\"{HEIGHT}\" \
             viewBox=\"0 0 {WIDTH} {HEIGHT}\" role=\"img\"><title>{}</title>\
             <text x=\"{MARGIN}\" y=\"16\" font-size=\"13\">{}</text>",
            escape(title),
            escape(title)
        );
        let (top, bottom) = (self.y(self.hi), self.y(self.lo));
        let _ = write!(
            s,
            "<line x1=\"{MARGIN}\" y1=\"{top}\" x2=\"{MARGIN}\" y2=\"{bottom}\" stroke=\"#888\"/>\
             <line x1=\"{MARGIN}\" y1=\"{bottom}\" x2=\"{}\" y2=\"{bottom}\" stroke=\"#888\"/>",
            WIDTH - MARGIN
        );
        for v in [self.lo, (self.lo + self.hi) / 2.0, self.hi] {
            let _ = write!(
                s,
                "<text x=\"{}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"end\">{}</text>",
                MARGIN - 4.0,
                self.y(v) + 3.0,
                escape(&label(v))
            );
        }
        s
    }

    /// A horizontal dashed line at `v`, labelled.
    fn limit(&self, v: f64, label: &str) -> String {
        let y = self.y(v);
        format!(
            "<line class=\"limit\" x1=\"{MARGIN}\" y1=\"{y:.1}\" x2=\"{}\" y2=\"{y:.1}\" \
             stroke=\"#b00\" stroke-dasharray=\"6 4\"/><text x=\"{}\" y=\"{:.1}\" \
             font-size=\"10\" fill=\"#b00\" text-anchor=\"end\">{}</text>",
            WIDTH - MARGIN,
            WIDTH - MARGIN,
            y - 3.0,
            escape(label)
        )
    }
}

/// A line through `(i, v)` with one `<circle class="point">` per value, each titled.
fn series(f: &Frame, values: &[(f64, String, bool)], colour: &str) -> String {
    let pts: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, (v, _, _))| format!("{:.1},{:.1}", f.x(i), f.y(*v)))
        .collect();
    let mut s = format!(
        "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1\" points=\"{}\"/>",
        pts.join(" ")
    );
    for (i, (v, title, pass)) in values.iter().enumerate() {
        let _ = write!(
            s,
            "<circle class=\"point\" cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{}\"><title>{}</title></circle>",
            f.x(i),
            f.y(*v),
            if *pass { colour } else { "#d00" },
            escape(title)
        );
    }
    s
}

fn status(pass: bool) -> &'static str {
    if pass {
        "<b class=\"pass\">PASS</b>"
    } else {
        "<b class=\"failed\">FAIL</b>"
    }
}

/// The `layers` page: NMSE (log scale, with the tolerance line) and cosine by activation site,
/// in forward order, then the table.
pub fn layers_html(r: &LayersReport) -> String {
    let n = r.entries.len();
    let log = |v: f64| v.max(NMSE_FLOOR).log10();
    let logs: Vec<f64> = r.entries.iter().map(|e| log(e.nmse)).collect();
    let limit = log(r.tolerance.max_nmse);
    let lo = logs.iter().copied().fold(limit, f64::min).floor();
    let hi = logs.iter().copied().fold(limit, f64::max).ceil();
    let f = Frame { n, lo, hi };
    let mut body = format!(
        "<h1>kiln-verify layers</h1><p>{} — model <code>{}</code> against <code>{}</code>, {} \
         tokens, {:?} weights: NMSE ≤ {:e}, top-1 ≥ {}.{}</p>\n",
        status(r.pass),
        escape(&r.model),
        escape(&r.reference),
        r.tokens,
        r.weight_class,
        r.tolerance.max_nmse,
        r.tolerance.min_top1,
        r.first_failure
            .as_ref()
            .map(|x| format!(" First out of tolerance: <code>{}</code>.", escape(x)))
            .unwrap_or_default()
    );
    let nmse: Vec<(f64, String, bool)> = r
        .entries
        .iter()
        .zip(&logs)
        .map(|(e, &l)| (l, format!("{}: NMSE {:.3e}", e.name, e.nmse), e.pass))
        .collect();
    body += &f.open("NMSE by activation site (log10)", |v| format!("1e{v:.0}"));
    body += &f.limit(limit, &format!("tolerance {:e}", r.tolerance.max_nmse));
    body += &series(&f, &nmse, "#1f5fa8");
    body += "</svg>\n";
    let cos: Vec<(f64, String, bool)> = r
        .entries
        .iter()
        .map(|e| {
            (
                e.cosine,
                format!("{}: cosine {:.9}", e.name, e.cosine),
                e.pass,
            )
        })
        .collect();
    let clo = cos.iter().map(|c| c.0).fold(1.0, f64::min);
    let cf = Frame {
        n,
        lo: if clo < 1.0 { clo } else { 1.0 - 1e-9 },
        hi: 1.0,
    };
    body += "<br>";
    body += &cf.open("Cosine similarity by activation site", |v| {
        format!("{v:.6}")
    });
    body += &series(&cf, &cos, "#2a8a3a");
    body += "</svg>\n";
    body += &layers_table(r);
    page(&format!("kiln-verify layers {}", r.model), &body)
}

/// The table of every activation site's figures, and the tensors not compared.
fn layers_table(r: &LayersReport) -> String {
    let mut s = String::new();
    s += "<table><tr><th>#</th><th>activation</th><th>shape</th><th>NMSE</th>\
             <th>cosine</th><th>max_abs</th><th>rms</th><th>top-1</th><th>result</th></tr>\n";
    for (i, e) in r.entries.iter().enumerate() {
        let _ = writeln!(
            s,
            "<tr{}><td>{i}</td><td>{}</td><td>{}×{}</td><td>{:.3e}</td><td>{:.9}</td>\
             <td>{:.3e}</td><td>{:.3e}</td><td>{}</td><td>{}</td></tr>",
            if e.pass { "" } else { " class=\"fail\"" },
            escape(&e.name),
            e.shape[0],
            e.shape[1],
            e.nmse,
            e.cosine,
            e.max_abs,
            e.rms,
            e.top1.map(|t| format!("{t:.4}")).unwrap_or_default(),
            if e.pass { "ok" } else { "FAIL" }
        );
    }
    s += "</table>\n";
    if !r.not_compared.is_empty() {
        let _ = writeln!(
            s,
            "<p>Not compared: {}</p>",
            escape(&r.not_compared.join(", "))
        );
    }
    s
}

/// The `perplexity` page: perplexity (and mean KL-divergence) by chunk, the histogram of
/// per-position KL-divergence against the base, the gates, and the per-chunk table.
pub fn perplexity_html(r: &PerplexityReport) -> String {
    let pass = r.per_chunk.iter().all(|c| c.ppl.is_finite()) && r.gates.iter().all(|g| g.pass);
    let mut body = format!(
        "<h1>kiln-verify perplexity</h1><p>{} — model <code>{}</code> on <code>{}</code>: \
         perplexity {:.4} ± {:.4} over {} chunks of {} ({} tokens scored, {} KV cache){}</p>\n",
        status(pass),
        escape(&r.model),
        escape(&r.text),
        r.ppl,
        r.ppl_stderr,
        r.chunks,
        r.ctx,
        r.tokens_scored,
        escape(r.cache_type),
        match (r.kld_mean, r.same_top_p, r.base_ppl) {
            (Some(k), Some(p), Some(b)) => format!(
                "; base perplexity {b:.4}, mean KL-divergence {k:.6}, same top token {:.2}%",
                p * 100.0
            ),
            _ => String::new(),
        }
    );
    if !r.gates.is_empty() {
        body += "<ul>";
        for g in &r.gates {
            let _ = write!(
                body,
                "<li>{} {}</li>",
                status(g.pass),
                escape(&g.describe())
            );
        }
        body += "</ul>\n";
    }
    let ppl: Vec<(f64, String, bool)> = r
        .per_chunk
        .iter()
        .enumerate()
        .map(|(i, c)| (c.ppl, format!("chunk {i}: perplexity {:.4}", c.ppl), true))
        .collect();
    let lo = ppl.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let hi = ppl.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
    let f = Frame {
        n: ppl.len(),
        lo: if lo.is_finite() { lo * 0.95 } else { 0.0 },
        hi: if hi.is_finite() { hi * 1.05 } else { 1.0 },
    };
    body += &f.open("Perplexity by chunk", |v| format!("{v:.2}"));
    body += &series(&f, &ppl, "#1f5fa8");
    body += "</svg>\n";
    if !r.kld_positions.is_empty() {
        body += "<br>";
        body += &histogram(
            &r.kld_positions,
            r.gates.iter().find(|g| g.name == "--max-kld"),
        );
    }
    body += "<table><tr><th>chunk</th><th>perplexity</th><th>mean KLD</th><th>seconds</th></tr>\n";
    for (i, c) in r.per_chunk.iter().enumerate() {
        let _ = writeln!(
            body,
            "<tr><td>{i}</td><td>{:.4}</td><td>{}</td><td>{:.3}</td></tr>",
            c.ppl,
            c.kld_mean.map(|k| format!("{k:.6}")).unwrap_or_default(),
            c.seconds
        );
    }
    body += "</table>\n";
    page(&format!("kiln-verify perplexity {}", r.model), &body)
}

/// Histogram of per-position KL-divergence, linear bins from 0 to the largest value.
fn histogram(kld: &[f32], gate: Option<&crate::perplexity::Gate>) -> String {
    let max = kld
        .iter()
        .copied()
        .fold(0f32, f32::max)
        .max(f32::MIN_POSITIVE) as f64;
    let mut counts = [0usize; HISTOGRAM_BINS];
    for &k in kld {
        let b = ((k.max(0.0) as f64 / max) * HISTOGRAM_BINS as f64) as usize;
        counts[b.min(HISTOGRAM_BINS - 1)] += 1;
    }
    let top = counts.iter().copied().max().unwrap_or(1).max(1) as f64;
    let f = Frame {
        n: HISTOGRAM_BINS + 1,
        lo: 0.0,
        hi: top,
    };
    let mut s = f.open(
        &format!(
            "KL-divergence per scored position ({} positions, 0 to {max:.4})",
            kld.len()
        ),
        |v| format!("{v:.0}"),
    );
    let w = f.x(1) - f.x(0);
    for (i, &c) in counts.iter().enumerate() {
        let (lo, hi) = (
            max * i as f64 / HISTOGRAM_BINS as f64,
            max * (i + 1) as f64 / HISTOGRAM_BINS as f64,
        );
        let y = f.y(c as f64);
        let _ = write!(
            s,
            "<rect class=\"bin\" x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" \
             fill=\"#7a4fa8\"><title>{lo:.5} – {hi:.5}: {c}</title></rect>",
            f.x(i),
            (w - 1.0).max(1.0),
            f.y(0.0) - y
        );
    }
    if let Some(g) = gate.filter(|g| g.allowed <= max) {
        let x = f.x(0) + (f.x(HISTOGRAM_BINS) - f.x(0)) * g.allowed / max;
        let _ = write!(
            s,
            "<line class=\"limit\" x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" \
             stroke=\"#b00\" stroke-dasharray=\"6 4\"><title>--max-kld {} (on the mean)</title></line>",
            f.y(top),
            f.y(0.0),
            g.allowed
        );
    }
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::Entry;
    use crate::tolerance::{WeightClass, TOL_F32};

    fn entry(name: &str, nmse: f64, pass: bool) -> Entry {
        Entry {
            name: name.into(),
            shape: [4, 8],
            max_abs: 0.1,
            rms: 0.01,
            rel: 0.01,
            cosine: 0.999,
            nmse,
            top1: None,
            pass,
        }
    }

    #[test]
    fn the_layers_page_has_one_point_per_site_and_no_external_reference() {
        for n in [1usize, 2, 7] {
            let entries: Vec<Entry> = (0..n)
                .map(|i| {
                    entry(
                        &format!("model.layers.{i}.output"),
                        10f64.powi(-(i as i32)),
                        i != 1,
                    )
                })
                .chain(std::iter::once(entry("logits", 0.0, true)))
                .collect();
            let r = LayersReport {
                model: "m<1>.kiln".into(),
                reference: "r&0.safetensors".into(),
                weight_class: WeightClass::F32,
                tolerance: TOL_F32,
                tokens: 4,
                pass: n < 2,
                first_failure: (n >= 2).then(|| "model.layers.1.output".into()),
                entries,
                not_compared: vec![],
            };
            let html = layers_html(&r);
            // Two charts (NMSE and cosine), one point per site in each.
            assert_eq!(
                html.matches("<circle class=\"point\"").count(),
                2 * (n + 1),
                "{n}"
            );
            assert_eq!(html.matches("<svg ").count(), 2);
            assert_eq!(html.matches("class=\"limit\"").count(), 1);
            // Inline SVG in HTML needs no namespace: the page names no URL at all.
            assert!(!html.contains("http://") && !html.contains("https://"));
            assert!(!html.contains("<script"));
            assert!(html.contains("m&lt;1&gt;.kiln") && html.contains("r&amp;0.safetensors"));
        }
    }
}
