//! The engine requests bound to one session, each under the fence it was reserved or submitted in
//! (vllm-omni's `DuplexRequestResource`s of a `DuplexSessionRuntimeState`). A cancel of a fence
//! hands back the requests bound under it; close hands back all of them. The session
//! (state.rs) checks that it accepts commands and that the fence is current; this module keeps
//! the bindings bounded and consistent.

use std::collections::BTreeMap;

use super::fence::Fence;
use crate::error::{ErrorCode, OrtexError, Result};

/// The most engine requests one session may hold bound at once. A session normally holds one or
/// two; the bound turns a leak into a visible, retryable refusal.
pub const MAX_REQUESTS_PER_SESSION: usize = 64;

/// An engine request bound to the session under a fence (vllm-omni's `DuplexRequestResource`,
/// without the stage id: ortex has one stage).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestResource {
    pub request_id: u32,
    pub fence: Fence,
    /// False while only reserved, true once the request was submitted to the engine.
    pub submitted: bool,
}

/// The bound requests by request id.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestBindings {
    resources: BTreeMap<u32, RequestResource>,
}

impl RequestBindings {
    /// The bound requests in request id order.
    pub fn iter(&self) -> impl Iterator<Item = &RequestResource> {
        self.resources.values()
    }

    /// Request ids bound under exactly `fence` (all when `None`) with the given submitted flag
    /// (either when `None`), in ascending order.
    pub fn request_ids(&self, fence: Option<&Fence>, submitted: Option<bool>) -> Vec<u32> {
        self.resources
            .values()
            .filter(|resource| fence.is_none_or(|fence| resource.fence == *fence))
            .filter(|resource| submitted.is_none_or(|submitted| resource.submitted == submitted))
            .map(|resource| resource.request_id)
            .collect()
    }

    /// Reserves `request_id` under `fence` (the session's current one). Reserving the same id
    /// again in the same epoch is a no-op, so a retried reservation is safe.
    pub fn reserve(&mut self, request_id: u32, fence: &Fence) -> Result<()> {
        if request_id == 0 {
            return Err(OrtexError::invalid("request id 0 names no request"));
        }
        if let Some(existing) = self.resources.get(&request_id) {
            if existing.fence.epoch != fence.epoch {
                return Err(OrtexError::invalid(format!("request {request_id} is already bound in another epoch")));
            }
            return Ok(());
        }
        if self.resources.len() >= MAX_REQUESTS_PER_SESSION {
            return Err(OrtexError::new(ErrorCode::CapacityExhausted, "too many requests bound to the session"));
        }
        let resource = RequestResource { request_id, fence: fence.clone(), submitted: false };
        self.resources.insert(request_id, resource);
        Ok(())
    }

    /// Records that a reserved `request_id` was submitted to the engine under `fence`.
    pub fn mark_submitted(&mut self, request_id: u32, fence: &Fence) {
        let resource = self.resources.get_mut(&request_id).expect("reserved before it is submitted");
        resource.fence = fence.clone();
        resource.submitted = true;
    }

    /// Forgets the given requests. Unknown ids are ignored, so a release retried after a partial
    /// failure is safe.
    pub fn release(&mut self, request_ids: &[u32]) {
        for request_id in request_ids {
            self.resources.remove(request_id);
        }
    }

    /// Forgets and returns every bound request.
    pub fn release_all(&mut self) -> Vec<u32> {
        let request_ids = self.request_ids(None, None);
        self.resources.clear();
        request_ids
    }

    pub fn is_empty(&self) -> bool {
        self.resources.is_empty()
    }

    /// Panics on a broken rule: bounded, keyed by request id, never ahead of the session's `fence`.
    pub fn check_invariants(&self, fence: &Fence) {
        assert!(self.resources.len() <= MAX_REQUESTS_PER_SESSION, "bindings are bounded");
        for (request_id, resource) in &self.resources {
            assert_eq!(*request_id, resource.request_id, "bindings are keyed by their request id");
            assert_ne!(*request_id, 0, "request id 0 names no request");
            assert!(resource.fence.same_identity(fence), "bindings belong to this session");
            assert!(resource.fence.key() <= fence.key(), "bindings are never ahead of the session");
        }
    }
}
