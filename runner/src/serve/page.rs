//! The chat page served at `GET /`.
//!
//! One self-contained HTML file (inline CSS and JavaScript, nothing fetched from elsewhere), so
//! the server works offline and a browser needs nothing but the server. It talks to the same
//! `/v1/chat/completions` endpoint as any client: streamed answers read as server-sent events,
//! a Stop button that aborts the request (the server then cancels the sequence), the API key
//! kept in the tab's `sessionStorage` and sent as a bearer token, and the decode rate of each
//! answer. Model output is only ever set as text, never parsed as HTML.

/// The page, compiled into the binary.
pub const PAGE: &str = include_str!("page.html");

#[cfg(test)]
mod tests {
    use super::PAGE;

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
