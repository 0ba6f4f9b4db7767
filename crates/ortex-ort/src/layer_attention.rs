//! [`AttentionPlan`]: what each layer's attention node is, what window it attends over, and
//! whether ortex must set that window in the graph before ONNX Runtime builds the session.
//!
//! The graph is the truth about what a layer computes; genai_config.json's
//! `model.decoder.sliding_window` says what it should compute. They are reconciled here:
//!
//! | graph node of layer l | genai_config window of l | what happens |
//! |-----------------------|--------------------------|--------------|
//! | GroupQueryAttention, `local_window_size` W > 0 | W or none | runs as it is |
//! | GroupQueryAttention, `local_window_size` W > 0 | W' != W | refused (they disagree) |
//! | GroupQueryAttention, `local_window_size` -1 | W | `local_window_size` set to W in the graph (onnxruntime-genai's builder writes Mistral's window only into the config) |
//! | MultiHeadAttention, Attention or plain operators | W | refused: no window ortex can set |
//!
//! ONNX Runtime's `local_window_size` W lets each query see itself and the W - 1 positions before
//! it, as Hugging Face's `sliding_window` W does (checked against transformers by
//! bench/model_coverage.py). A layer with `sliding_window_cache = 1` keeps a past buffer of a
//! capacity of its own; [`AttentionPlan::window_cache_width`] says how wide it must be.

use crate::config::{ModelConfig, TensorNames};
use crate::onnx_graph::Node;

/// Which operator computes a layer's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionOp {
    /// `com.microsoft.GroupQueryAttention`.
    GroupQuery,
    /// `com.microsoft.MultiHeadAttention`.
    MultiHead,
    /// `com.microsoft.Attention` (packed).
    Packed,
    /// `com.microsoft.PagedAttention`: ONNX Runtime has it on CUDA only.
    Paged,
    /// Plain ONNX operators (the past goes into a Concat).
    Plain,
}

impl AttentionOp {
    fn of(node: &Node) -> Option<AttentionOp> {
        match (node.domain.as_str(), node.op_type.as_str()) {
            ("com.microsoft", "GroupQueryAttention") => Some(AttentionOp::GroupQuery),
            ("com.microsoft", "MultiHeadAttention") => Some(AttentionOp::MultiHead),
            ("com.microsoft", "Attention") => Some(AttentionOp::Packed),
            ("com.microsoft", "PagedAttention") => Some(AttentionOp::Paged),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AttentionOp::GroupQuery => "GroupQueryAttention",
            AttentionOp::MultiHead => "MultiHeadAttention",
            AttentionOp::Packed => "Attention",
            AttentionOp::Paged => "PagedAttention",
            AttentionOp::Plain => "plain ONNX operators",
        }
    }
}

/// One layer's attention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerAttention {
    pub op: AttentionOp,
    /// The window each query attends over (itself included), once the plan is applied.
    pub window: Option<u32>,
    /// GroupQueryAttention with `sliding_window_cache = 1`: its past buffer has a capacity of its
    /// own, at least `window`.
    pub window_cache: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionPlan {
    pub layers: Vec<LayerAttention>,
    /// Indices (in the graph's node list) of the GroupQueryAttention nodes whose
    /// `local_window_size` must be set to `window_to_set` before the session is built.
    pub nodes_to_window: Vec<usize>,
    pub window_to_set: u32,
}

impl AttentionPlan {
    /// Reconciles the graph's attention nodes with the config's sliding window (see the module
    /// comment). Err is the reason, naming the field and the layer.
    pub fn new(config: &ModelConfig, nodes: &[Node]) -> Result<AttentionPlan, String> {
        let mut plan = AttentionPlan { layers: Vec::new(), nodes_to_window: Vec::new(), window_to_set: 0 };
        for layer in 0..config.num_hidden_layers as usize {
            let past_key = TensorNames::layer(&config.names.past_key, layer);
            // The attention node that takes the layer's past; else (the builder's float16
            // MultiHeadAttention, fed the past concatenated and repeated) the one named for the
            // layer.
            let attention_nodes =
                || nodes.iter().enumerate().filter_map(|(i, node)| Some((i, node, AttentionOp::of(node)?)));
            let layer_name = format!("/layers.{layer}/");
            let found = attention_nodes()
                .find(|(_, node, _)| node.inputs.contains(&past_key))
                .or_else(|| attention_nodes().find(|(_, node, _)| node.name.contains(&layer_name)));
            let wanted = config.window_of(layer);
            let attention = match found {
                Some((index, node, AttentionOp::GroupQuery)) => {
                    let graph_window = node.int("local_window_size").filter(|&w| w > 0);
                    let window_cache = node.int("sliding_window_cache") == Some(1);
                    match (graph_window, wanted) {
                        (Some(graph), Some(want)) if graph != i64::from(want) => {
                            return Err(format!(
                                "model.decoder.sliding_window.window_size is {want} but layer {layer}'s \
                                 GroupQueryAttention ({}) has local_window_size {graph}",
                                node.name
                            ))
                        }
                        (None, Some(want)) => {
                            plan.nodes_to_window.push(index);
                            plan.window_to_set = want;
                        }
                        _ => {}
                    }
                    let window = wanted.or(graph_window.map(|w| w as u32));
                    LayerAttention {
                        op: AttentionOp::GroupQuery,
                        window,
                        window_cache: window_cache && window.is_some(),
                    }
                }
                found => {
                    let op = found.map_or(AttentionOp::Plain, |(_, _, op)| op);
                    if let Some(want) = wanted {
                        return Err(format!(
                            "model.decoder.sliding_window asks layer {layer} to attend over a window of {want}, but \
                             its attention is {}, which has no window ortex can set",
                            op.name()
                        ));
                    }
                    LayerAttention { op, window: None, window_cache: false }
                }
            };
            plan.layers.push(attention);
        }
        Ok(plan)
    }

    /// The least sequence width of layer `layer`'s past buffers: its window for a windowed
    /// cache, else 0.
    pub fn window_cache_width(&self, layer: usize) -> usize {
        let attention = &self.layers[layer];
        match (attention.window_cache, attention.window) {
            (true, Some(window)) => window as usize,
            _ => 0,
        }
    }

    /// Whether any layer uses `op`.
    pub fn uses(&self, op: AttentionOp) -> bool {
        self.layers.iter().any(|l| l.op == op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SlidingWindow;

    fn config(window: Option<SlidingWindow>) -> ModelConfig {
        ModelConfig::for_tests(window)
    }

    fn node(op_type: &str, layer: usize, ints: &[(&str, i64)]) -> Node {
        Node {
            name: format!("/model/layers.{layer}/attn/{op_type}"),
            op_type: op_type.into(),
            domain: "com.microsoft".into(),
            inputs: vec!["q".into(), format!("past_key_values.{layer}.key"), format!("past_key_values.{layer}.value")],
            outputs: vec![],
            ints: ints.iter().map(|&(n, v)| (n.to_string(), v)).collect(),
            floats: vec![],
        }
    }

    fn window(size: u32, layers: &[u32]) -> Option<SlidingWindow> {
        Some(SlidingWindow { window_size: size, layers: layers.to_vec() })
    }

    #[test]
    fn a_windowed_cache_layer_as_gemma2_folders_have_it() {
        let nodes = [
            node("GroupQueryAttention", 0, &[("local_window_size", 16), ("sliding_window_cache", 1)]),
            node("GroupQueryAttention", 1, &[("local_window_size", -1)]),
        ];
        let plan = AttentionPlan::new(&config(window(16, &[0])), &nodes).unwrap();
        assert_eq!(
            plan.layers[0],
            LayerAttention { op: AttentionOp::GroupQuery, window: Some(16), window_cache: true }
        );
        assert_eq!(plan.layers[1].window, None);
        assert_eq!((plan.window_cache_width(0), plan.window_cache_width(1)), (16, 0));
        assert!(plan.nodes_to_window.is_empty());
    }

    #[test]
    fn a_window_only_in_the_config_is_set_in_the_graph() {
        let nodes = [
            node("GroupQueryAttention", 0, &[("local_window_size", -1)]),
            node("GroupQueryAttention", 1, &[("local_window_size", -1)]),
        ];
        let plan = AttentionPlan::new(&config(window(32, &[])), &nodes).unwrap();
        assert_eq!((plan.nodes_to_window.clone(), plan.window_to_set), (vec![0, 1], 32));
        assert!(plan.layers.iter().all(|l| l.window == Some(32) && !l.window_cache));
        // Without a config window, nothing changes.
        let plain = AttentionPlan::new(&config(None), &nodes).unwrap();
        assert!(plain.nodes_to_window.is_empty() && plain.layers.iter().all(|l| l.window.is_none()));
    }

    #[test]
    fn disagreements_and_windows_ortex_cannot_set_are_refused() {
        let gqa = [
            node("GroupQueryAttention", 0, &[("local_window_size", 16)]),
            node("GroupQueryAttention", 1, &[("local_window_size", -1)]),
        ];
        let error = AttentionPlan::new(&config(window(8, &[0])), &gqa).unwrap_err();
        assert!(error.contains("window_size is 8") && error.contains("local_window_size 16"), "{error}");
        let mha = [node("MultiHeadAttention", 0, &[]), node("MultiHeadAttention", 1, &[])];
        let error = AttentionPlan::new(&config(window(8, &[])), &mha).unwrap_err();
        assert!(error.contains("MultiHeadAttention, which has no window"), "{error}");
        // The builder's float16 MultiHeadAttention takes the past concatenated and repeated: found
        // by its name.
        let mut repeated = mha.clone();
        for n in &mut repeated {
            n.inputs.retain(|i| !i.starts_with("past_key_values"));
        }
        let plan = AttentionPlan::new(&config(None), &repeated).unwrap();
        assert!(plan.layers.iter().all(|l| l.op == AttentionOp::MultiHead));
        let error = AttentionPlan::new(&config(window(8, &[1])), &[]).unwrap_err();
        assert!(error.contains("layer 1") && error.contains("plain ONNX operators"), "{error}");
        let plan = AttentionPlan::new(&config(None), &mha).unwrap();
        assert!(plan.uses(AttentionOp::MultiHead) && !plan.uses(AttentionOp::GroupQuery));
    }
}
