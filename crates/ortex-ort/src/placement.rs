//! Which execution provider runs each node of a session, as ONNX Runtime assigned them.
//!
//! ONNX Runtime (1.24 and newer) records the assignment when the session option
//! `session.record_ep_graph_assignment_info` is "1" and returns it through
//! `Session_GetEpGraphAssignmentInfo`: per provider, the nodes it runs (name, domain, op type).
//! Without it the only report is the session's VERBOSE log ("Node placements", session_state.cc),
//! which needs the whole process's log level at VERBOSE and a parser of free text; the API gives
//! the same facts as data.
//!
//! A CUDA session places some nodes on the CPU on purpose (ONNX Runtime assigns shape arithmetic
//! to the CPU provider) and others because the CUDA provider has no kernel for them (an op, or an
//! element type): [`NodePlacement::fallback_summary`] names them all, counted by op type, so a
//! folder that cannot run fully on CUDA says so instead of running part of itself on the CPU
//! silently.

use std::collections::BTreeMap;
use std::ffi::{c_char, CStr};

use ort::session::Session;
use ort::AsPointer;

/// The session option that makes ONNX Runtime record the assignment.
pub const RECORD_ASSIGNMENT_CONFIG: &str = "session.record_ep_graph_assignment_info";

/// ONNX Runtime's name of its CPU provider in the assignment.
pub const CPU_PROVIDER: &str = "CPUExecutionProvider";

/// Per execution provider ("CUDAExecutionProvider", "CPUExecutionProvider"), its nodes counted by
/// op type (`domain:OpType` outside the default ONNX domain, e.g. `com.microsoft:RotaryEmbedding`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePlacement {
    pub providers: BTreeMap<String, BTreeMap<String, u32>>,
}

impl NodePlacement {
    /// Counts one node of `op_type` (in `domain`) on `provider`.
    pub fn add(&mut self, provider: &str, domain: &str, op_type: &str) {
        let key =
            if domain.is_empty() || domain == "ai.onnx" { op_type.to_string() } else { format!("{domain}:{op_type}") };
        *self.providers.entry(provider.to_string()).or_default().entry(key).or_default() += 1;
    }

    /// The number of nodes on `provider` (0 when it runs none).
    pub fn nodes_on(&self, provider: &str) -> u32 {
        self.providers.get(provider).map_or(0, |ops| ops.values().sum())
    }

    pub fn total_nodes(&self) -> u32 {
        self.providers.values().flat_map(|ops| ops.values()).sum()
    }

    /// For a session that asked for `preferred`: the nodes ONNX Runtime put on the CPU instead, as
    /// one sentence ("12 of 340 nodes run on the CPU, not CUDAExecutionProvider: Shape x4, Gather
    /// x3, ..."), op types by count, most first. None when every node runs on `preferred` (or the
    /// CPU is what was asked for).
    pub fn fallback_summary(&self, preferred: &str) -> Option<String> {
        if preferred == CPU_PROVIDER {
            return None;
        }
        let ops = self.providers.get(CPU_PROVIDER).filter(|ops| !ops.is_empty())?;
        let mut counted: Vec<(&String, &u32)> = ops.iter().collect();
        counted.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        let listed: Vec<String> = counted.iter().map(|(op, n)| format!("{op} x{n}")).collect();
        Some(format!(
            "{} of {} nodes run on the CPU, not {preferred}: {}",
            self.nodes_on(CPU_PROVIDER),
            self.total_nodes(),
            listed.join(", ")
        ))
    }
}

/// Reads the assignment ONNX Runtime recorded for `session` (opened with
/// [`RECORD_ASSIGNMENT_CONFIG`] = "1"). An error names the call that failed.
pub fn read(session: &Session) -> Result<NodePlacement, String> {
    let api = ort::api();
    let mut subgraphs: *const *const ort::sys::OrtEpAssignedSubgraph = std::ptr::null();
    let mut count = 0usize;
    // SAFETY: the session is live for this call; the arrays and strings ONNX Runtime returns are
    // owned by the session and only read here, while it is borrowed.
    unsafe {
        check((api.Session_GetEpGraphAssignmentInfo)(session.ptr(), &mut subgraphs, &mut count), "the assignment")?;
        let mut placement = NodePlacement::default();
        for &subgraph in raw_slice(subgraphs, count) {
            let mut provider: *const c_char = std::ptr::null();
            check((api.EpAssignedSubgraph_GetEpName)(subgraph, &mut provider), "a provider's name")?;
            let provider = text(provider);
            let mut nodes: *const *const ort::sys::OrtEpAssignedNode = std::ptr::null();
            let mut node_count = 0usize;
            check((api.EpAssignedSubgraph_GetNodes)(subgraph, &mut nodes, &mut node_count), "a provider's nodes")?;
            for &node in raw_slice(nodes, node_count) {
                let (mut domain, mut op_type): (*const c_char, *const c_char) = (std::ptr::null(), std::ptr::null());
                check((api.EpAssignedNode_GetDomain)(node, &mut domain), "a node's domain")?;
                check((api.EpAssignedNode_GetOperatorType)(node, &mut op_type), "a node's op type")?;
                placement.add(&provider, &text(domain), &text(op_type));
            }
        }
        Ok(placement)
    }
}

/// SAFETY: `status` comes from ONNX Runtime and is consumed once.
unsafe fn check(status: ort::sys::OrtStatusPtr, what: &str) -> Result<(), String> {
    unsafe { ort::Error::result_from_status(status) }.map_err(|e| format!("cannot read {what}: {e}"))
}

/// SAFETY: `items` holds `count` pointers (or is null with count 0) that outlive the slice.
unsafe fn raw_slice<'a, T>(items: *const *const T, count: usize) -> &'a [*const T] {
    if items.is_null() || count == 0 {
        return &[];
    }
    unsafe { std::slice::from_raw_parts(items, count) }
}

/// SAFETY: `value` is null or a NUL-terminated string that outlives the call.
unsafe fn text(value: *const c_char) -> String {
    if value.is_null() {
        return String::new();
    }
    unsafe { CStr::from_ptr(value) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(nodes: &[(&str, &str, &str)]) -> NodePlacement {
        let mut placement = NodePlacement::default();
        for (provider, domain, op) in nodes {
            placement.add(provider, domain, op);
        }
        placement
    }

    #[test]
    fn names_the_nodes_a_cuda_session_runs_on_the_cpu_by_op_type_most_first() {
        let placement = placement(&[
            ("CUDAExecutionProvider", "", "MatMul"),
            ("CUDAExecutionProvider", "com.microsoft", "GroupQueryAttention"),
            ("CPUExecutionProvider", "", "Shape"),
            ("CPUExecutionProvider", "", "Gather"),
            ("CPUExecutionProvider", "", "Shape"),
            ("CPUExecutionProvider", "com.microsoft", "MatMulNBits"),
        ]);
        assert_eq!(placement.total_nodes(), 6);
        assert_eq!(placement.nodes_on(CPU_PROVIDER), 4);
        assert_eq!(
            placement.fallback_summary("CUDAExecutionProvider").as_deref(),
            Some("4 of 6 nodes run on the CPU, not CUDAExecutionProvider: Shape x2, Gather x1, com.microsoft:MatMulNBits x1")
        );
    }

    #[test]
    fn says_nothing_when_every_node_runs_where_asked() {
        let all_cuda = placement(&[("CUDAExecutionProvider", "", "MatMul"), ("CUDAExecutionProvider", "", "Add")]);
        assert_eq!(all_cuda.fallback_summary("CUDAExecutionProvider"), None);
        let cpu = placement(&[(CPU_PROVIDER, "", "MatMul")]);
        assert_eq!(cpu.fallback_summary(CPU_PROVIDER), None);
        assert_eq!(NodePlacement::default().fallback_summary("CUDAExecutionProvider"), None);
    }

    #[test]
    fn the_default_onnx_domain_is_left_out_of_op_names() {
        let placement =
            placement(&[(CPU_PROVIDER, "ai.onnx", "Add"), (CPU_PROVIDER, "com.microsoft", "SkipLayerNorm")]);
        let ops: Vec<&String> = placement.providers[CPU_PROVIDER].keys().collect();
        assert_eq!(ops, ["Add", "com.microsoft:SkipLayerNorm"]);
    }
}
