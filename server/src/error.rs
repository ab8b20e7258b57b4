//! The server's one error type: what can stop it from serving at all (a refused request is an
//! [`crate::api::ApiError`] answered to its client, never this).

/// Why the server could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A socket or runtime operation failed; `what` says which.
    #[error("{what}: {source}")]
    Io {
        /// What the server was doing.
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

impl ServerError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        ServerError::Io {
            what: what.into(),
            source,
        }
    }
}
