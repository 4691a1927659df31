//! Cutting llama.cpp's per-sequence state into per-block pages and back.
//!
//! The blob (`llama_state_seq_get_data`), little-endian, as measured in
//! `shared/KV-STATE-NOTES.md`:
//!
//! ```text
//! u32 magic 0xAF143CD8 | i32 seq_id | u32 n_stream | per stream: u32 cell_count, then if > 0:
//!   cells:  cell_count × (i32 pos, u32 n_seq_id, n_seq_id × i32 seq_id)
//!   header: u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v
//!   K:      per layer: i32 type, u64 row_bytes, cell_count rows
//!   V:      v_trans = 0: per layer: i32 type, u64 row_bytes, cell_count rows
//!           v_trans = 1: per layer: i32 type, u32 el_bytes, u32 n_embd_v, n_embd_v × cell_count elements
//! ```
//!
//! A page holds the K and V of `block` consecutive positions, all layers, with no
//! positions or sequence ids (a page's positions are implied by its index in the
//! chain). [`split`] requires the sequence to hold exactly positions `0..n`;
//! [`assemble`] rebuilds a blob for the first `k` pages that llama.cpp restores
//! into any sequence of a context with the same layout.

/// Magic at the start of a sequence-state blob.
pub const STATE_MAGIC: u32 = 0xAF14_3CD8;

/// Why a blob could not be cut or a page used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    /// The blob ended early or has an unknown shape.
    #[error("malformed sequence state: {0}")]
    Malformed(String),
    /// The sequence is not a plain prefix `0..n` (shifted, fragmented positions, shared cells).
    #[error("sequence is not pageable: {0}")]
    NotPageable(String),
    /// A page does not have the size this layout needs.
    #[error("page of {got} bytes, layout needs {want}")]
    PageSize {
        /// Bytes found.
        got: usize,
        /// Bytes expected.
        want: usize,
    },
}

/// V layout of one layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VLayer {
    /// One row per cell.
    Rows {
        /// ggml type.
        ty: i32,
        /// Bytes per row.
        row: u64,
    },
    /// Transposed: `n_embd` components, each `cell_count` elements.
    Trans {
        /// ggml type.
        ty: i32,
        /// Bytes per element.
        el: u32,
        /// Components.
        n_embd: u32,
    },
}

impl VLayer {
    fn cell_bytes(&self) -> usize {
        match self {
            VLayer::Rows { row, .. } => *row as usize,
            VLayer::Trans { el, n_embd, .. } => (*el as usize) * (*n_embd as usize),
        }
    }
}

/// Shape of the KV data of one model + context configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Streams of the context the blob came from (rewritten on assembly).
    pub n_stream: u32,
    /// 1 when V is stored transposed (flash attention off).
    pub v_trans: u32,
    /// Layers.
    pub n_layer: u32,
    /// Rotation applied to quantized K.
    pub n_rot_k: u32,
    /// Rotation applied to quantized V.
    pub n_rot_v: u32,
    /// K per layer: (ggml type, row bytes).
    pub k: Vec<(i32, u64)>,
    /// V per layer.
    pub v: Vec<VLayer>,
}

impl Layout {
    /// KV bytes of one cell over all layers.
    pub fn cell_bytes(&self) -> usize {
        self.k.iter().map(|(_, r)| *r as usize).sum::<usize>()
            + self.v.iter().map(VLayer::cell_bytes).sum::<usize>()
    }

    /// Bytes of one page of `block` cells.
    pub fn page_bytes(&self, block: usize) -> usize {
        self.cell_bytes() * block
    }

    /// Everything that must match for a page to be restorable (not `n_stream`, which
    /// assembly rewrites): part of the page salt.
    pub fn descriptor(&self) -> Vec<u8> {
        let mut d = Vec::new();
        for x in [self.v_trans, self.n_layer, self.n_rot_k, self.n_rot_v] {
            d.extend_from_slice(&x.to_le_bytes());
        }
        for (ty, row) in &self.k {
            d.extend_from_slice(&ty.to_le_bytes());
            d.extend_from_slice(&row.to_le_bytes());
        }
        for v in &self.v {
            match v {
                VLayer::Rows { ty, row } => {
                    d.push(0);
                    d.extend_from_slice(&ty.to_le_bytes());
                    d.extend_from_slice(&row.to_le_bytes());
                }
                VLayer::Trans { ty, el, n_embd } => {
                    d.push(1);
                    d.extend_from_slice(&ty.to_le_bytes());
                    d.extend_from_slice(&el.to_le_bytes());
                    d.extend_from_slice(&n_embd.to_le_bytes());
                }
            }
        }
        d
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| {
                CodecError::Malformed(format!(
                    "blob ends at {} but {} more bytes were needed at {}",
                    self.b.len(),
                    n,
                    self.at
                ))
            })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn i32(&mut self) -> Result<i32, CodecError> {
        Ok(i32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

/// A parsed sequence: its layout and KV data in position order.
#[derive(Debug)]
pub struct SeqKv {
    /// Shape.
    pub layout: Layout,
    /// Cells (= positions `0..n_cells`).
    pub n_cells: usize,
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
}

const MAX_CELLS: u32 = 1 << 24;
const MAX_LAYERS: u32 = 4096;

/// Parses a blob from `llama_state_seq_get_data` of one sequence.
pub fn parse(blob: &[u8]) -> Result<SeqKv, CodecError> {
    let mut r = Reader { b: blob, at: 0 };
    let magic = r.u32()?;
    if magic != STATE_MAGIC {
        return Err(CodecError::Malformed(format!("magic {magic:#x}")));
    }
    let _seq = r.i32()?;
    let n_stream = r.u32()?;
    if n_stream == 0 || n_stream > 4096 {
        return Err(CodecError::Malformed(format!("n_stream {n_stream}")));
    }
    let mut found: Option<SeqKv> = None;
    for _ in 0..n_stream {
        let cells = r.u32()?;
        if cells == 0 {
            continue;
        }
        if found.is_some() {
            return Err(CodecError::NotPageable(
                "cells in more than one stream".into(),
            ));
        }
        if cells > MAX_CELLS {
            return Err(CodecError::Malformed(format!("cell_count {cells}")));
        }
        let n = cells as usize;
        let mut pos = Vec::with_capacity(n);
        for _ in 0..n {
            let p = r.i32()?;
            let n_seq = r.u32()?;
            if n_seq != 1 {
                return Err(CodecError::NotPageable(format!(
                    "cell shared by {n_seq} sequences"
                )));
            }
            let _ = r.i32()?;
            pos.push(p);
        }
        // Order of cells by position; positions must be exactly 0..n.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| pos[i]);
        if order
            .iter()
            .enumerate()
            .any(|(want, &i)| pos[i] != want as i32)
        {
            return Err(CodecError::NotPageable("positions are not 0..n".into()));
        }
        let v_trans = r.u32()?;
        let n_layer = r.u32()?;
        if n_layer == 0 || n_layer > MAX_LAYERS || v_trans > 1 {
            return Err(CodecError::Malformed(format!(
                "v_trans {v_trans}, n_layer {n_layer}"
            )));
        }
        let n_rot_k = r.u32()?;
        let n_rot_v = r.u32()?;
        let mut layout = Layout {
            n_stream,
            v_trans,
            n_layer,
            n_rot_k,
            n_rot_v,
            k: vec![],
            v: vec![],
        };
        let mut k = Vec::with_capacity(n_layer as usize);
        for _ in 0..n_layer {
            let ty = r.i32()?;
            let row = r.u64()?;
            let rows = r.take(
                n.checked_mul(row as usize)
                    .ok_or_else(|| CodecError::Malformed("K size".into()))?,
            )?;
            let mut sorted = Vec::with_capacity(rows.len());
            for &i in &order {
                sorted.extend_from_slice(&rows[i * row as usize..(i + 1) * row as usize]);
            }
            layout.k.push((ty, row));
            k.push(sorted);
        }
        let mut v = Vec::with_capacity(n_layer as usize);
        for _ in 0..n_layer {
            let ty = r.i32()?;
            if v_trans == 0 {
                let row = r.u64()?;
                let rows = r.take(
                    n.checked_mul(row as usize)
                        .ok_or_else(|| CodecError::Malformed("V size".into()))?,
                )?;
                let mut sorted = Vec::with_capacity(rows.len());
                for &i in &order {
                    sorted.extend_from_slice(&rows[i * row as usize..(i + 1) * row as usize]);
                }
                layout.v.push(VLayer::Rows { ty, row });
                v.push(sorted);
            } else {
                let el = r.u32()? as usize;
                let n_embd = r.u32()? as usize;
                // Zero-sized elements would make the loop below run `n_embd` (up to 2^32)
                // times over no data; no ggml type has them.
                if el == 0 {
                    return Err(CodecError::Malformed("V element size 0".into()));
                }
                let data = r.take(
                    n.checked_mul(el)
                        .and_then(|x| x.checked_mul(n_embd))
                        .ok_or_else(|| CodecError::Malformed("V size".into()))?,
                )?;
                let mut sorted = Vec::with_capacity(data.len());
                for j in 0..n_embd {
                    let comp = &data[j * n * el..(j + 1) * n * el];
                    for &i in &order {
                        sorted.extend_from_slice(&comp[i * el..(i + 1) * el]);
                    }
                }
                layout.v.push(VLayer::Trans {
                    ty,
                    el: el as u32,
                    n_embd: n_embd as u32,
                });
                v.push(sorted);
            }
        }
        found = Some(SeqKv {
            layout,
            n_cells: n,
            k,
            v,
        });
    }
    found.ok_or_else(|| CodecError::NotPageable("empty sequence".into()))
}

impl SeqKv {
    /// Payload of page `index` (cells `index*block .. (index+1)*block`), if that block is full.
    pub fn page(&self, index: usize, block: usize) -> Option<Vec<u8>> {
        let (a, b) = (index * block, (index + 1) * block);
        if b > self.n_cells {
            return None;
        }
        let mut out = Vec::with_capacity(self.layout.page_bytes(block));
        for ((_, row), k) in self.layout.k.iter().zip(&self.k) {
            out.extend_from_slice(&k[a * *row as usize..b * *row as usize]);
        }
        for (vl, v) in self.layout.v.iter().zip(&self.v) {
            match vl {
                VLayer::Rows { row, .. } => {
                    out.extend_from_slice(&v[a * *row as usize..b * *row as usize])
                }
                VLayer::Trans { el, n_embd, .. } => {
                    let (el, n) = (*el as usize, self.n_cells);
                    for j in 0..*n_embd as usize {
                        out.extend_from_slice(&v[(j * n + a) * el..(j * n + b) * el]);
                    }
                }
            }
        }
        Some(out)
    }

    /// Number of full blocks.
    pub fn full_blocks(&self, block: usize) -> usize {
        self.n_cells / block
    }
}

/// Builds a restorable blob from the first pages of a chain, for a context with
/// `n_stream` streams.
pub fn assemble(
    layout: &Layout,
    pages: &[&[u8]],
    block: usize,
    n_stream: u32,
) -> Result<Vec<u8>, CodecError> {
    let want = layout.page_bytes(block);
    if let Some(p) = pages.iter().find(|p| p.len() != want) {
        return Err(CodecError::PageSize { got: p.len(), want });
    }
    let n = pages.len() * block;
    let mut out = Vec::with_capacity(64 + n * (12 + layout.cell_bytes()));
    let w32 = |o: &mut Vec<u8>, x: u32| o.extend_from_slice(&x.to_le_bytes());
    w32(&mut out, STATE_MAGIC);
    out.extend_from_slice(&0i32.to_le_bytes());
    w32(&mut out, n_stream.max(1));
    w32(&mut out, n as u32);
    for p in 0..n {
        out.extend_from_slice(&(p as i32).to_le_bytes());
        w32(&mut out, 1);
        out.extend_from_slice(&0i32.to_le_bytes());
    }
    for x in [
        layout.v_trans,
        layout.n_layer,
        layout.n_rot_k,
        layout.n_rot_v,
    ] {
        w32(&mut out, x);
    }
    // Offsets of each layer's part inside a page.
    let mut off = 0usize;
    for (ty, row) in &layout.k {
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(&row.to_le_bytes());
        let len = block * *row as usize;
        for p in pages {
            out.extend_from_slice(&p[off..off + len]);
        }
        off += len;
    }
    for vl in &layout.v {
        match vl {
            VLayer::Rows { ty, row } => {
                out.extend_from_slice(&ty.to_le_bytes());
                out.extend_from_slice(&row.to_le_bytes());
                let len = block * *row as usize;
                for p in pages {
                    out.extend_from_slice(&p[off..off + len]);
                }
                off += len;
            }
            VLayer::Trans { ty, el, n_embd } => {
                out.extend_from_slice(&ty.to_le_bytes());
                w32(&mut out, *el);
                w32(&mut out, *n_embd);
                let comp = block * *el as usize;
                for j in 0..*n_embd as usize {
                    for p in pages {
                        out.extend_from_slice(&p[off + j * comp..off + (j + 1) * comp]);
                    }
                }
                off += comp * *n_embd as usize;
            }
        }
    }
    for _ in 1..n_stream.max(1) {
        w32(&mut out, 0);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic blob: `n` cells stored in `perm` order, 2 layers, K row 4 bytes, V as given.
    fn blob(n: usize, perm: &[usize], v_trans: bool, n_stream: u32) -> Vec<u8> {
        let mut b = vec![];
        b.extend_from_slice(&STATE_MAGIC.to_le_bytes());
        b.extend_from_slice(&3i32.to_le_bytes());
        b.extend_from_slice(&n_stream.to_le_bytes());
        b.extend_from_slice(&(n as u32).to_le_bytes());
        for &p in perm {
            b.extend_from_slice(&(p as i32).to_le_bytes());
            b.extend_from_slice(&1u32.to_le_bytes());
            b.extend_from_slice(&3i32.to_le_bytes());
        }
        for x in [v_trans as u32, 2, 0, 0] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        for l in 0..2u8 {
            b.extend_from_slice(&1i32.to_le_bytes());
            b.extend_from_slice(&4u64.to_le_bytes());
            for &p in perm {
                b.extend_from_slice(&[l, p as u8, 0xA, 0xB]);
            }
        }
        for l in 0..2u8 {
            b.extend_from_slice(&1i32.to_le_bytes());
            if v_trans {
                b.extend_from_slice(&2u32.to_le_bytes());
                b.extend_from_slice(&3u32.to_le_bytes());
                for j in 0..3u8 {
                    for &p in perm {
                        b.extend_from_slice(&[l + 10, j * 16 + p as u8]);
                    }
                }
            } else {
                b.extend_from_slice(&2u64.to_le_bytes());
                for &p in perm {
                    b.extend_from_slice(&[l + 10, p as u8]);
                }
            }
        }
        for _ in 1..n_stream {
            b.extend_from_slice(&0u32.to_le_bytes());
        }
        b
    }

    #[test]
    fn split_and_assemble_roundtrip() {
        for v_trans in [false, true] {
            let sorted: Vec<usize> = (0..8).collect();
            let original = blob(8, &sorted, v_trans, 1);
            let kv = parse(&original).unwrap();
            assert_eq!(kv.full_blocks(4), 2);
            let pages: Vec<Vec<u8>> = (0..2).map(|i| kv.page(i, 4).unwrap()).collect();
            assert!(kv.page(2, 4).is_none());
            let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
            let mut rebuilt = assemble(&kv.layout, &refs, 4, 1).unwrap();
            rebuilt[4..8].copy_from_slice(&3i32.to_le_bytes()); // seq id differs only
            let mut orig_seq0 = original.clone();
            orig_seq0[4..8].copy_from_slice(&3i32.to_le_bytes());
            // Our assembly writes seq id 0 in cells; the source had 3.
            let fix = |b: &mut Vec<u8>| {
                for c in 0..8 {
                    let at = 16 + c * 12 + 8;
                    b[at..at + 4].copy_from_slice(&0i32.to_le_bytes());
                }
            };
            fix(&mut orig_seq0);
            assert_eq!(rebuilt, orig_seq0, "v_trans {v_trans}");
            // A prefix of one page equals the blob of the first 4 cells.
            let first = assemble(&kv.layout, &refs[..1], 4, 1).unwrap();
            let mut want = blob(4, &sorted[..4], v_trans, 1);
            want[4..8].copy_from_slice(&0i32.to_le_bytes());
            fix4(&mut want);
            assert_eq!(first, want);
        }
    }

    fn fix4(b: &mut [u8]) {
        for c in 0..4 {
            let at = 16 + c * 12 + 8;
            b[at..at + 4].copy_from_slice(&0i32.to_le_bytes());
        }
    }

    #[test]
    fn cells_out_of_order_are_sorted_by_position() {
        let perm = [3usize, 0, 2, 1, 7, 5, 6, 4];
        let shuffled = parse(&blob(8, &perm, true, 1)).unwrap();
        let sorted = parse(&blob(8, &(0..8).collect::<Vec<_>>(), true, 1)).unwrap();
        for i in 0..2 {
            assert_eq!(shuffled.page(i, 4), sorted.page(i, 4));
        }
    }

    /// Found by the `page_decode` fuzz target (a timeout): a transposed V layer of 0-byte
    /// elements and 2^32 - 1 components needs no data, and parsing spun over the components.
    #[test]
    fn zero_sized_v_elements_are_refused() {
        let mut b = vec![];
        for x in [STATE_MAGIC, 0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 0] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        b.extend_from_slice(&1u64.to_le_bytes()); // K row: 1 byte
        b.push(7);
        for x in [0, 0, u32::MAX] {
            b.extend_from_slice(&x.to_le_bytes()); // V: type, element bytes, components
        }
        let t = std::time::Instant::now();
        assert_eq!(
            parse(&b).unwrap_err(),
            CodecError::Malformed("V element size 0".into())
        );
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn refuses_what_it_cannot_page() {
        assert!(matches!(parse(&[1, 2, 3]), Err(CodecError::Malformed(_))));
        let good = blob(8, &(0..8).collect::<Vec<_>>(), false, 1);
        for cut in [10, 40, good.len() - 1] {
            assert!(
                matches!(parse(&good[..cut]), Err(CodecError::Malformed(_))),
                "cut {cut}"
            );
        }
        // A gap in positions.
        let gap = blob(4, &[0, 1, 2, 5], false, 1);
        assert!(matches!(parse(&gap), Err(CodecError::NotPageable(_))));
        let kv = parse(&good).unwrap();
        assert!(matches!(
            assemble(&kv.layout, &[&[0u8; 3]], 4, 1),
            Err(CodecError::PageSize { .. })
        ));
        // Streams are rewritten for the destination.
        let p = kv.page(0, 4).unwrap();
        let multi = assemble(&kv.layout, &[&p], 4, 4).unwrap();
        assert_eq!(u32::from_le_bytes(multi[8..12].try_into().unwrap()), 4);
        assert_eq!(parse(&multi).unwrap().n_cells, 4);
    }
}
