//! The chat page served at `/`.

/// The page.
pub const PAGE: &str = "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>kiln-run</title></head><body><p>kiln-run serve</p></body></html>\n";
