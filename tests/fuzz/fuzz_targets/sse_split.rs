//! The client's SSE splitter (`mesh::client::SseSplitter`): the same bytes cut into chunks
//! anywhere give the same `data: ` payloads as in one chunk, and every payload is one
//! line with no trailing whitespace.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh::client::SseSplitter;

fn split<'a>(chunks: impl IntoIterator<Item = &'a [u8]>) -> Vec<String> {
    let mut sse = SseSplitter::default();
    let mut out = vec![];
    for c in chunks {
        sse.push(c);
        while let Some(d) = sse.next_data() {
            out.push(d);
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    // The first byte seeds the chunk sizes (1 to 8 bytes).
    let Some((&seed, stream)) = data.split_first() else {
        return;
    };
    let mut x = u32::from(seed) | 0x100;
    let mut chunks = vec![];
    let mut rest = stream;
    while !rest.is_empty() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let n = (1 + x as usize % 8).min(rest.len());
        let (c, r) = rest.split_at(n);
        chunks.push(c);
        rest = r;
    }
    let whole = split([stream]);
    assert_eq!(split(chunks), whole);
    assert!(whole.len() <= stream.iter().filter(|&&b| b == b'\n').count());
    for d in &whole {
        assert!(!d.contains('\n') && d.trim_end() == d, "{d:?}");
    }
});
