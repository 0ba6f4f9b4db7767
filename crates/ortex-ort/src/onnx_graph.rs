//! The decoder graph's nodes, read straight from `model.onnx`'s protobuf bytes (ONNX Runtime does
//! not expose node attributes), and one edit: setting an integer attribute of some nodes.
//!
//! Only the path ModelProto.graph (7) -> GraphProto.node (1) -> NodeProto {input 1, output 2,
//! name 3, op_type 4, attribute 5, domain 7} -> AttributeProto {name 1, f 2, i 3, type 20} is
//! decoded; every other field is skipped when reading and copied verbatim when editing. Weights
//! stored in the file are skipped over, never copied out.

use std::ops::Range;

/// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

/// AttributeProto.AttributeType.INT
const ATTRIBUTE_INT: u64 = 2;

/// One node of the top-level graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: String,
    pub op_type: String,
    pub domain: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    /// Integer attributes by name.
    pub ints: Vec<(String, i64)>,
    /// Float attributes by name.
    pub floats: Vec<(String, f32)>,
}

impl Node {
    pub fn int(&self, name: &str) -> Option<i64> {
        self.ints.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
    }

    pub fn float(&self, name: &str) -> Option<f32> {
        self.floats.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
    }
}

/// Why the bytes are not an ONNX model ortex can read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphError(pub String);

impl std::fmt::Display for GraphError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

type Result<T> = std::result::Result<T, GraphError>;

fn malformed(what: &str) -> GraphError {
    GraphError(format!("not a valid ONNX model ({what})"))
}

/// One field of a message: its number, wire type, the whole field's bytes and its value's.
struct FieldAt {
    number: u64,
    wire: u8,
    whole: Range<usize>,
    value: Range<usize>,
    varint: u64,
}

fn read_varint(bytes: &[u8], at: &mut usize) -> Result<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*at).ok_or_else(|| malformed("truncated varint"))?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(malformed("varint longer than 10 bytes"))
}

fn write_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// The fields of a message, in order.
fn fields(bytes: &[u8]) -> Result<Vec<FieldAt>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let start = at;
        let tag = read_varint(bytes, &mut at)?;
        let (number, wire) = (tag >> 3, (tag & 7) as u8);
        let (value, varint) = match wire {
            VARINT => {
                let v = read_varint(bytes, &mut at)?;
                (start..at, v)
            }
            FIXED64 => (at..at + 8, 0),
            FIXED32 => (at..at + 4, 0),
            LEN => {
                let len = usize::try_from(read_varint(bytes, &mut at)?).map_err(|_| malformed("huge length"))?;
                (at..at.checked_add(len).ok_or_else(|| malformed("huge length"))?, 0)
            }
            _ => return Err(malformed("unsupported wire type")),
        };
        if value.end > bytes.len() {
            return Err(malformed("truncated field"));
        }
        if wire != VARINT {
            at = value.end;
        }
        out.push(FieldAt { number, wire, whole: start..at, value, varint });
    }
    Ok(out)
}

fn string(bytes: &[u8], field: &FieldAt) -> Result<String> {
    String::from_utf8(bytes[field.value.clone()].to_vec()).map_err(|_| malformed("a name is not UTF-8"))
}

/// The bytes of the model's top-level graph.
fn graph_range(model: &[u8]) -> Result<Range<usize>> {
    fields(model)?
        .into_iter()
        .find(|f| f.number == 7 && f.wire == LEN)
        .map(|f| f.value)
        .ok_or_else(|| malformed("no graph"))
}

/// The top-level graph's nodes, in order.
pub fn read_nodes(model: &[u8]) -> Result<Vec<Node>> {
    let graph = &model[graph_range(model)?];
    let mut nodes = Vec::new();
    for field in fields(graph)? {
        if field.number == 1 && field.wire == LEN {
            nodes.push(read_node(&graph[field.value])?);
        }
    }
    Ok(nodes)
}

/// The value of metadata entry `key` (ModelProto.metadata_props (14) -> StringStringEntryProto
/// {key 1, value 2}), when the model has it.
pub fn read_metadata(model: &[u8], key: &str) -> Result<Option<String>> {
    for field in fields(model)? {
        if field.number != 14 || field.wire != LEN {
            continue;
        }
        let entry = &model[field.value];
        let (mut k, mut v) = (None, None);
        for part in fields(entry)? {
            match (part.number, part.wire) {
                (1, LEN) => k = Some(string(entry, &part)?),
                (2, LEN) => v = Some(string(entry, &part)?),
                _ => {}
            }
        }
        if k.as_deref() == Some(key) {
            return Ok(v);
        }
    }
    Ok(None)
}

fn read_node(bytes: &[u8]) -> Result<Node> {
    let mut node = Node {
        name: String::new(),
        op_type: String::new(),
        domain: String::new(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        ints: Vec::new(),
        floats: Vec::new(),
    };
    for field in fields(bytes)? {
        match (field.number, field.wire) {
            (1, LEN) => node.inputs.push(string(bytes, &field)?),
            (2, LEN) => node.outputs.push(string(bytes, &field)?),
            (3, LEN) => node.name = string(bytes, &field)?,
            (4, LEN) => node.op_type = string(bytes, &field)?,
            (7, LEN) => node.domain = string(bytes, &field)?,
            (5, LEN) => read_attribute(&bytes[field.value], &mut node)?,
            _ => {}
        }
    }
    Ok(node)
}

fn read_attribute(bytes: &[u8], node: &mut Node) -> Result<()> {
    let (mut name, mut int, mut float) = (None, None, None);
    for field in fields(bytes)? {
        match (field.number, field.wire) {
            (1, LEN) => name = Some(string(bytes, &field)?),
            (2, FIXED32) => {
                let raw: [u8; 4] = bytes[field.value].try_into().expect("4 bytes");
                float = Some(f32::from_le_bytes(raw));
            }
            (3, VARINT) => int = Some(field.varint as i64),
            _ => {}
        }
    }
    let name = name.ok_or_else(|| malformed("an attribute without a name"))?;
    if let Some(v) = int {
        node.ints.push((name.clone(), v));
    }
    if let Some(v) = float {
        node.floats.push((name, v));
    }
    Ok(())
}

fn push_len_field(out: &mut Vec<u8>, number: u64, value: &[u8]) {
    write_varint(out, number << 3 | u64::from(LEN));
    write_varint(out, value.len() as u64);
    out.extend_from_slice(value);
}

/// The model with integer attribute `attribute` of the nodes at `nodes` (indices into
/// [`read_nodes`]) set to `value` (added where the node lacks it); everything else is unchanged.
pub fn set_int_attribute(model: &[u8], nodes: &[usize], attribute: &str, value: i64) -> Result<Vec<u8>> {
    let graph_at = graph_range(model)?;
    let graph = &model[graph_at.clone()];
    let mut new_graph = Vec::with_capacity(graph.len() + 16 * nodes.len());
    let mut index = 0;
    for field in fields(graph)? {
        if field.number == 1 && field.wire == LEN {
            if nodes.contains(&index) {
                let node = set_in_node(&graph[field.value.clone()], attribute, value)?;
                push_len_field(&mut new_graph, 1, &node);
            } else {
                new_graph.extend_from_slice(&graph[field.whole.clone()]);
            }
            index += 1;
        } else {
            new_graph.extend_from_slice(&graph[field.whole.clone()]);
        }
    }
    let mut out = Vec::with_capacity(model.len() + new_graph.len() - graph.len() + 8);
    for field in fields(model)? {
        if field.value == graph_at {
            push_len_field(&mut out, 7, &new_graph);
        } else {
            out.extend_from_slice(&model[field.whole.clone()]);
        }
    }
    Ok(out)
}

fn int_attribute(name: &str, value: i64) -> Vec<u8> {
    let mut attr = Vec::new();
    push_len_field(&mut attr, 1, name.as_bytes());
    write_varint(&mut attr, 3 << 3 | u64::from(VARINT));
    write_varint(&mut attr, value as u64);
    write_varint(&mut attr, 20 << 3 | u64::from(VARINT));
    write_varint(&mut attr, ATTRIBUTE_INT);
    attr
}

fn set_in_node(node: &[u8], attribute: &str, value: i64) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(node.len() + 32);
    let mut found = false;
    for field in fields(node)? {
        let is_it = field.number == 5 && field.wire == LEN && {
            let attr = &node[field.value.clone()];
            fields(attr)?
                .iter()
                .any(|f| f.number == 1 && f.wire == LEN && attr[f.value.clone()] == *attribute.as_bytes())
        };
        if is_it {
            push_len_field(&mut out, 5, &int_attribute(attribute, value));
            found = true;
        } else {
            out.extend_from_slice(&node[field.whole]);
        }
    }
    if !found {
        push_len_field(&mut out, 5, &int_attribute(attribute, value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn float_attribute(name: &str, value: f32) -> Vec<u8> {
        let mut attr = Vec::new();
        push_len_field(&mut attr, 1, name.as_bytes());
        write_varint(&mut attr, 2 << 3 | u64::from(FIXED32));
        attr.extend_from_slice(&value.to_le_bytes());
        attr
    }

    /// A model with a producer name (field 2), two metadata entries (field 14), a graph of two
    /// nodes and an initializer, and an opset import (field 8) after the graph.
    fn model() -> Vec<u8> {
        let mut gqa = Vec::new();
        for input in ["q", "past_key_values.0.key"] {
            push_len_field(&mut gqa, 1, input.as_bytes());
        }
        push_len_field(&mut gqa, 2, b"out");
        push_len_field(&mut gqa, 3, b"/attn");
        push_len_field(&mut gqa, 4, b"GroupQueryAttention");
        push_len_field(&mut gqa, 5, &int_attribute("num_heads", 4));
        push_len_field(&mut gqa, 5, &int_attribute("local_window_size", -1));
        push_len_field(&mut gqa, 5, &float_attribute("softcap", 50.0));
        push_len_field(&mut gqa, 7, b"com.microsoft");
        let mut add = Vec::new();
        push_len_field(&mut add, 1, b"x");
        push_len_field(&mut add, 4, b"Add");
        let mut graph = Vec::new();
        push_len_field(&mut graph, 1, &add);
        push_len_field(&mut graph, 5, &[0x08, 0x01, 0x4a, 0x04, 1, 2, 3, 4]); // an initializer
        push_len_field(&mut graph, 1, &gqa);
        let mut model = Vec::new();
        write_varint(&mut model, 1 << 3);
        write_varint(&mut model, 10); // ir_version
        push_len_field(&mut model, 2, b"producer");
        for (key, value) in [("ortex.attention", "paged"), ("ortex.paged_kernel", "cuda")] {
            let mut entry = Vec::new();
            push_len_field(&mut entry, 1, key.as_bytes());
            push_len_field(&mut entry, 2, value.as_bytes());
            push_len_field(&mut model, 14, &entry);
        }
        push_len_field(&mut model, 7, &graph);
        push_len_field(&mut model, 8, b"\x0a\x00\x10\x15");
        model
    }

    #[test]
    fn reads_metadata_by_key() {
        let model = model();
        assert_eq!(read_metadata(&model, "ortex.paged_kernel").unwrap().as_deref(), Some("cuda"));
        assert_eq!(read_metadata(&model, "ortex.attention").unwrap().as_deref(), Some("paged"));
        assert_eq!(read_metadata(&model, "ortex.seed").unwrap(), None);
    }

    #[test]
    fn reads_nodes_with_their_attributes() {
        let nodes = read_nodes(&model()).unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[0].op_type, "Add");
        let gqa = &nodes[1];
        assert_eq!((gqa.name.as_str(), gqa.domain.as_str()), ("/attn", "com.microsoft"));
        assert_eq!(gqa.inputs, ["q", "past_key_values.0.key"]);
        assert_eq!(gqa.outputs, ["out"]);
        assert_eq!((gqa.int("num_heads"), gqa.int("local_window_size"), gqa.int("missing")), (Some(4), Some(-1), None));
        assert_eq!(gqa.float("softcap"), Some(50.0));
    }

    #[test]
    fn setting_an_attribute_changes_only_it() {
        let before = model();
        let after = set_int_attribute(&before, &[1], "local_window_size", 16).unwrap();
        let (old, new) = (read_nodes(&before).unwrap(), read_nodes(&after).unwrap());
        assert_eq!(new[1].int("local_window_size"), Some(16));
        assert_eq!(new[1].int("num_heads"), Some(4));
        assert_eq!(new[1].float("softcap"), Some(50.0));
        assert_eq!(new[0], old[0]);
        // The fields around the graph are kept, in order.
        let numbers = |m: &[u8]| fields(m).unwrap().iter().map(|f| f.number).collect::<Vec<_>>();
        assert_eq!(numbers(&after), numbers(&before));
        assert!(after.ends_with(b"\x0a\x00\x10\x15"));
        // A node without the attribute gets it.
        let added = set_int_attribute(&before, &[0], "local_window_size", 8).unwrap();
        assert_eq!(read_nodes(&added).unwrap()[0].int("local_window_size"), Some(8));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let full = model();
        for cut in 1..full.len() {
            let _ = read_nodes(&full[..cut]);
        }
        assert!(read_nodes(&[0xff; 12]).is_err());
        assert!(read_nodes(b"").is_err());
    }
}
