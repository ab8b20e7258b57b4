//! The one routing table, and every limit as a layer on it.
//!
//! Order, outermost first: the `Host` and `Expect` checks, CORS (when origins are named), the body limit,
//! then routing; on the API routes (`/health` and the page aside) the in-flight limit, then
//! the API key. So a request is refused on its head (no route, a wrong method, no key, a
//! declared body over the limit) before its body is read, and before a client that sent
//! `Expect: 100-continue` is told to send it.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use axum::body::Bytes;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri, Version};
use axum::middleware::{self, Next};
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kiln_runner::serve::log;
use serde_json::Value;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::load_shed::LoadShedLayer;
use tower::{BoxError, ServiceBuilder};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::api::ApiError;
use crate::front::answer::Events;
use crate::front::{App, Kind, Pending};
use crate::page;

type Shared = State<Arc<App<'static>>>;

/// The routes, their limits and their answers.
pub(crate) fn router(app: Arc<App<'static>>) -> Router {
    let auth = || middleware::from_fn_with_state(app.clone(), authorize);
    let busy = app.cfg.max_requests;
    let in_flight = ServiceBuilder::new()
        .layer(HandleErrorLayer::new(
            move |method: Method, uri: Uri, e: BoxError| overloaded(method, uri, e, busy),
        ))
        .layer(LoadShedLayer::new())
        .layer(GlobalConcurrencyLimitLayer::new(
            app.cfg.max_requests.max(1),
        ));
    let api = Router::new()
        .route("/v1/models", get(models).route_layer(auth()))
        .route("/v1/chat/completions", post(chat).route_layer(auth()))
        .route("/v1/completions", post(completions).route_layer(auth()))
        .route("/v1/embeddings", post(embeddings).route_layer(auth()))
        .route("/tokenize", post(tokenize).route_layer(auth()))
        .route("/detokenize", post(detokenize).route_layer(auth()))
        .layer(in_flight);
    let mut router = Router::new()
        .route("/", get(chat_page))
        .route("/health", get(health))
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(app.cfg.max_body_bytes));
    if let Some(cors) = cors(&app.cfg.cors_origins) {
        router = router.layer(cors);
    }
    router
        .layer(middleware::from_fn(check_head))
        .with_state(app)
}

/// CORS for the named origins only (none: no layer, so no CORS headers at all). Credentials
/// are never allowed, and no origin is reflected that was not named.
fn cors(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let list: Vec<HeaderValue> = origins
        .iter()
        .filter_map(|o| HeaderValue::from_str(o).ok())
        .collect();
    Some(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(list))
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
    )
}

/// One log line about a request; [`log::line`] escapes what the client sent.
fn log_request(method: &Method, path: &str, status: u16, message: &str) {
    log::line(format_args!("{method} {path} {status}: {message}"));
}

/// Log `e` and answer with it, with the headers its status calls for.
fn error(method: &Method, path: &str, e: &ApiError) -> Response {
    log_request(method, path, e.status, &e.message);
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, json_body(&e.to_json())).into_response();
    let headers = response.headers_mut();
    match e.status {
        503 => {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        401 => {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        _ => {}
    }
    response
}

/// A JSON body with its content type.
fn json_body(v: &Value) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        v.to_string(),
    )
}

/// The answer when every in-flight place is taken.
async fn overloaded(method: Method, uri: Uri, e: BoxError, limit: usize) -> Response {
    let message = if e.is::<tower::load_shed::error::Overloaded>() {
        format!("the server is busy: {limit} requests are in flight; retry")
    } else {
        format!("the server failed: {e}")
    };
    let e = ApiError::new(503, "server_error", message);
    error(&method, uri.path(), &e)
}

/// What hyper leaves to the server about a head: HTTP/1.1 requires exactly one `Host` (two
/// could route differently in a proxy in front), and an `Expect` other than `100-continue`
/// cannot be met (417).
async fn check_head(req: Request, next: Next) -> Response {
    let hosts = req.headers().get_all(header::HOST).iter().count();
    let required = req.version() >= Version::HTTP_11;
    let refusal = if hosts > 1 {
        Some((
            400,
            "the request has more than one Host header; send one".into(),
        ))
    } else if hosts == 0 && required {
        Some((
            400,
            "the request has no Host header; HTTP/1.1 requires one".into(),
        ))
    } else {
        req.headers()
            .get(header::EXPECT)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .filter(|v| !v.eq_ignore_ascii_case("100-continue"))
            .map(|v| {
                let message = format!("unsupported Expect `{v}`; only 100-continue is understood");
                (417, message)
            })
    };
    if let Some((status, message)) = refusal {
        let e = ApiError::new(status, "invalid_request_error", message);
        return error(req.method(), req.uri().path(), &e);
    }
    next.run(req).await
}

async fn authorize(State(app): Shared, req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match app.authorize(given) {
        Ok(()) => next.run(req).await,
        Err(e) => error(req.method(), req.uri().path(), &e),
    }
}

async fn not_found(req: Request) -> Response {
    let (method, path) = (req.method(), req.uri().path());
    let e = ApiError::new(
        404,
        "invalid_request_error",
        format!("no route {method} {path}"),
    );
    error(method, path, &e)
}

/// The method each route takes, for the 405's message (axum adds `Allow`).
fn method_of(path: &str) -> &'static str {
    match path {
        "/" | "/health" | "/v1/models" => "GET",
        _ => "POST",
    }
}

async fn method_not_allowed(req: Request) -> Response {
    let (method, path) = (req.method(), req.uri().path());
    let e = ApiError::new(
        405,
        "invalid_request_error",
        format!("{path} takes {}, not {method}", method_of(path)),
    );
    error(method, path, &e)
}

/// The chat page, with headers that keep it from being framed, sniffed or made to load
/// anything but itself and the API.
async fn chat_page() -> Response {
    let mut response = axum::response::Html(page::PAGE).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(page::content_security_policy()),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

async fn health(State(app): Shared) -> Response {
    json_body(&app.health()).into_response()
}

async fn models(State(app): Shared) -> Response {
    let m = &app.model;
    json_body(&crate::api::models(&m.name, m.created)).into_response()
}

/// A request's body, read within the request timeout and the body limit. A declared length
/// over the limit is refused before a byte of the body is read.
async fn body(app: &App<'_>, req: Request) -> Result<Bytes, ApiError> {
    let limit = app.cfg.max_body_bytes;
    if let Some(length) = declared_length(req.headers()).filter(|&n| n > limit as u64) {
        return Err(too_large(Some(length), limit));
    }
    let read = Bytes::from_request(req, &());
    match tokio::time::timeout(app.cfg.request_timeout, read).await {
        Err(_) => Err(ApiError::new(
            408,
            "timeout_error",
            "the request was not received in time",
        )),
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(too_large(None, limit)),
        Ok(Err(e)) => Err(ApiError::new(
            400,
            "invalid_request_error",
            format!("malformed request: {}", e.body_text()),
        )),
    }
}

fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// The 413 for a body of `length` bytes (declared), or one found longer than `limit` while
/// it was read (chunked).
fn too_large(length: Option<u64>, limit: usize) -> ApiError {
    let message = match length {
        Some(n) => format!("the request body is {n} bytes, more than the server accepts ({limit})"),
        None => format!("the request body is more than the server accepts ({limit} bytes)"),
    };
    ApiError::new(413, "invalid_request_error", message)
}

/// Run `work` on the blocking pool with the request's body: what the API's routes do
/// (tokenizing, rendering, compiling a schema, embedding) must not hold a runtime thread.
async fn blocking<T: Send + 'static>(
    app: &Arc<App<'static>>,
    req: Request,
    work: impl FnOnce(&App<'static>, &[u8]) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let bytes = body(app, req).await?;
    let app = app.clone();
    tokio::task::spawn_blocking(move || work(&app, &bytes))
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::new(
                500,
                "server_error",
                format!("the request failed: {e}"),
            ))
        })
}

/// A JSON answer, or the error's.
fn answer(method: &Method, path: &str, result: Result<Value, ApiError>) -> Response {
    match result {
        Ok(v) => json_body(&v).into_response(),
        Err(e) => error(method, path, &e),
    }
}

async fn tokenize(State(app): Shared, req: Request) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    answer(&method, &path, blocking(&app, req, App::tokenize).await)
}

async fn detokenize(State(app): Shared, req: Request) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    answer(&method, &path, blocking(&app, req, App::detokenize).await)
}

/// Raises its flag when dropped: the handler's future was dropped, so its client went away.
struct Gone(Arc<AtomicBool>);

impl Drop for Gone {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

async fn embeddings(State(app): Shared, req: Request) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let gone = Gone(Arc::new(AtomicBool::new(false)));
    let flag = gone.0.clone();
    let result = blocking(&app, req, move |app, body| app.embeddings(body, &flag)).await;
    drop(gone);
    answer(&method, &path, result)
}

async fn chat(State(app): Shared, req: Request) -> Response {
    generation(app, Kind::Chat, req).await
}

async fn completions(State(app): Shared, req: Request) -> Response {
    generation(app, Kind::Completion, req).await
}

/// Validate and submit a generation, then answer with its events: one JSON body, or
/// Server-Sent Events. Dropping this future (the client went away) cancels the job.
async fn generation(app: Arc<App<'static>>, kind: Kind, req: Request) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let started = blocking(&app, req, move |app, body| match kind {
        Kind::Chat => app.chat(body),
        Kind::Completion => app.completion(body),
    })
    .await;
    let Pending {
        events,
        cancel,
        output,
        stream,
        include_usage,
    } = match started {
        Ok(s) => s,
        Err(e) => return error(&method, &path, &e),
    };
    let events = Events::bridge(events, cancel, app.stop.clone());
    if stream {
        let what = format!("{method} {path}");
        Sse::new(output.stream(events, include_usage, what)).into_response()
    } else {
        answer(&method, &path, output.collect(events).await)
    }
}
