//! The chat output parser (`mesh_tiers::chat::parse_output`) on arbitrary text: it never
//! panics, every call it finds began at a `<tool_call>` of the text, and every call it
//! parsed renders (`render_call`) back into text that parses to the same call.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_tiers::chat::{parse_output, render_call, CALL, THINK};
use serde_json::Value;

/// serde_json's default float parsing is not always correctly rounded, so a float may not
/// survive text exactly: calls holding one are not compared.
fn has_float(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.is_f64(),
        Value::Array(a) => a.iter().any(has_float),
        Value::Object(o) => o.values().any(has_float),
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let p = parse_output(&text);
    assert!(p.tool_calls.len() + p.malformed_calls <= text.matches(CALL).count());
    assert_eq!(p.reasoning.is_some(), text.trim_start().starts_with(THINK));
    assert_eq!(p.content.trim(), p.content);
    for c in &p.tool_calls {
        assert!(c.arguments.is_object());
        if has_float(&c.arguments) {
            continue;
        }
        let again = parse_output(&render_call(c));
        assert_eq!(again.tool_calls, vec![c.clone()], "{:?}", render_call(c));
        assert_eq!((again.malformed_calls, again.content.as_str()), (0, ""));
    }
});
