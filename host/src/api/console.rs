//! The operator console: static files under `/console/` on the admin
//! listener, embedded in the binary (no CDN, works offline).
//!
//! The console is a client of the admin API and nothing else: these routes
//! serve only the page, its script and its style, and need no token (the
//! page holds no data). Every value it shows comes from `/admin/v1/` with the
//! admin token as a bearer header, which the page keeps in session storage;
//! a tenant key gets the API's 401 like any other wrong token.
//!
//! Each file goes out with a Content-Security-Policy that allows scripts,
//! styles and requests from this origin only (no inline script or style, no
//! framing, no form posts elsewhere), `nosniff`, and no referrer; the script
//! builds the page from text nodes, never HTML, so a value crafted as markup
//! shows as text.

use axum::body::Body;
use axum::http::{header, HeaderValue, Response, StatusCode};
use axum::routing::get;
use axum::Router;

/// What every console response carries.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// The console's files: (path under `/console/`, content type, bytes).
const FILES: &[(&str, &str, &[u8])] = &[
    (
        "",
        "text/html; charset=utf-8",
        include_bytes!("../../console/index.html"),
    ),
    (
        "console.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../console/console.js"),
    ),
    (
        "console.css",
        "text/css; charset=utf-8",
        include_bytes!("../../console/console.css"),
    ),
];

/// The console's routes (any state).
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    let mut router = Router::new().route("/console", get(redirect));
    for &(path, content_type, bytes) in FILES {
        router = router.route(
            &format!("/console/{path}"),
            get(move || async move { file(content_type, bytes) }),
        );
    }
    router
}

fn secured(mut response: Response<Body>) -> Response<Body> {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // A new binary's console replaces the old one at the next load.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

fn file(content_type: &'static str, bytes: &'static [u8]) -> Response<Body> {
    let mut response = Response::new(Body::from(bytes));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    secured(response)
}

async fn redirect() -> Response<Body> {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::PERMANENT_REDIRECT;
    response
        .headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static("/console/"));
    secured(response)
}
