//! The chat page served at `GET /`.
//!
//! One self-contained HTML file (inline CSS and JavaScript, nothing fetched from elsewhere), so
//! the server works offline and a browser needs nothing but the server. It talks to the same
//! `/v1/chat/completions` endpoint as any client: streamed answers read as server-sent events,
//! a Stop button that aborts the request (the server then cancels the sequence), the API key
//! kept in the tab's `sessionStorage` and sent as a bearer token, and the decode rate of each
//! answer. Model output is only ever set as text, never parsed as HTML.

use std::sync::OnceLock;

use sha2::{Digest, Sha256};

use crate::api::embeddings::base64;

/// The page, compiled into the binary.
pub const PAGE: &str = include_str!("page.html");

/// The page's `Content-Security-Policy`: its one inline script by its SHA-256 (so nothing
/// injected into the page could run), its inline style, requests to its own origin (the API),
/// nothing else loaded, no base or form targets, never framed.
pub fn content_security_policy() -> &'static str {
    static POLICY: OnceLock<String> = OnceLock::new();
    POLICY.get_or_init(|| {
        let hash = base64(&Sha256::digest(inline_script(PAGE).as_bytes()));
        format!(
            "default-src 'none'; script-src 'sha256-{hash}'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
             frame-ancestors 'none'"
        )
    })
}

/// The text of the page's `<script>` element, as a browser hashes it.
fn inline_script(page: &str) -> &str {
    let start = page.find("<script>").map_or(0, |i| i + "<script>".len());
    let end = page[start..]
        .find("</script>")
        .map_or(page.len(), |i| start + i);
    &page[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_allows_exactly_the_one_inline_script() {
        assert_eq!(PAGE.matches("<script").count(), 1);
        let script = inline_script(PAGE);
        assert!(script.contains("fetch(\"/v1/chat/completions\""));
        assert!(!script.contains("</script>"));
        let policy = content_security_policy();
        assert!(policy.contains("script-src 'sha256-") && !policy.contains("unsafe-eval"));
        // The known hash of a known text, so the base64 and the digest are what browsers use.
        assert_eq!(
            base64(&Sha256::digest(b"abc")),
            "ungWv48Bz+pBQUDeXa4iI7ADYaOWF3qctBD/YfIAFa0="
        );
    }

    #[test]
    fn page_is_self_contained() {
        // No script, style sheet, font or image from another origin: the page must work with
        // the server alone.
        for needle in ["src=\"http", "href=\"http", "@import", "url(", "//cdn"] {
            assert!(
                !PAGE.contains(needle),
                "page refers to an outside resource: {needle}"
            );
        }
    }

    #[test]
    fn page_has_the_elements_the_browser_test_drives() {
        for id in [
            "input",
            "send",
            "stop",
            "messages",
            "tps",
            "system",
            "temperature",
            "max-tokens",
            "api-key",
        ] {
            assert!(
                PAGE.contains(&format!("id=\"{id}\"")),
                "no element with id {id}"
            );
        }
    }

    #[test]
    fn page_never_puts_text_in_as_html() {
        assert!(!PAGE.contains("innerHTML"));
        assert!(!PAGE.contains("insertAdjacentHTML"));
        assert!(!PAGE.contains("document.write"));
    }
}
