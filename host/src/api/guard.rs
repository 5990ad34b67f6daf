//! The runtime canary guard on a response's way out (see
//! [`crate::tenancy::canary`]): generated text passes through the request's
//! [`OutputGuard`] before it is sent, streamed or not.

use super::error::ApiError;
use super::App;
use crate::engine::request::RequestId;
use crate::tenancy::canary::{Hit, Scanner};
use crate::tenancy::control::{self, Actor, Control};
use crate::tenancy::Tenant;
use std::sync::Arc;

/// One response's scanner and what a hit must record.
pub struct OutputGuard {
    scanner: Scanner,
    request: RequestId,
    tenant: String,
    control: Arc<Control>,
}

impl OutputGuard {
    /// The guard of `tenant`'s request `request`: `None` when the operator has
    /// not turned the guard on, or no tenant has registered a canary.
    pub fn new(app: &App, tenant: &Tenant, request: RequestId) -> Option<OutputGuard> {
        if !app.serving.canary_guard {
            return None;
        }
        let directory = app.control.registry().snapshot();
        Some(OutputGuard {
            scanner: directory.canaries()?.scanner(tenant.id),
            request,
            tenant: tenant.name.clone(),
            control: Arc::clone(&app.control),
        })
    }

    /// Takes the next piece of generated text; answers what may be sent now,
    /// or the error that ends the response.
    pub fn text(&mut self, text: &str) -> Result<String, ApiError> {
        self.scanner.push(text).map_err(|hit| self.blocked(hit))
    }

    /// The end of the text: what is still held back, or the error.
    pub fn finish(&mut self) -> Result<String, ApiError> {
        self.scanner.finish().map_err(|hit| self.blocked(hit))
    }

    /// Counts, logs and audits a hit (ids and names, never the canary).
    fn blocked(&self, hit: Hit) -> ApiError {
        let owner = self
            .control
            .registry()
            .snapshot()
            .tenant(hit.owner)
            .map_or_else(|| format!("#{}", hit.owner.0), |t| t.name.clone());
        tracing::error!(
            request_id = self.request.0,
            tenant = %self.tenant,
            canary_owner = %owner,
            "the canary guard blocked a response carrying another tenant's canary"
        );
        crate::telemetry::count_canary_hit(&self.tenant, &owner);
        let mut record = control::audit(
            &Actor::System,
            "request.output_blocked",
            &self.request.0.to_string(),
        );
        record
            .detail
            .insert("tenant".into(), self.tenant.clone().into());
        record.detail.insert("canary_owner".into(), owner.into());
        record
            .detail
            .insert("canary_owner_id".into(), hit.owner.0.into());
        self.control.usage_book().security(record);
        ApiError::OutputBlocked
    }
}
