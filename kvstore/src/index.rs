//! Which peers hold which pages: one index over every peer's advertised pages, read in
//! place when a request is routed or its prefix pulled.
//!
//! A page id is a chain hash (`id::chain`): it names its whole prefix, not just its own
//! block. So the path of a prompt through a radix tree of prefixes is a sequence of point
//! lookups, one per page, and a hash map from id to holders is that tree with its edges
//! implied. A prompt's run on a node is how many of its leading pages the node holds;
//! [`PrefixIndex::runs`] walks the pages once, narrowing the set of nodes still matching,
//! and stops when none is left.
//!
//! ```text
//! space (namespace, salt base, block) ─▶ id ─▶ holders [node, ...]
//!                                      node ─▶ its ids (to replace a node's set)
//! ```
//!
//! Pure: the membership table feeds it each peer's advertised ids ([`PrefixIndex::set_node`])
//! and drops a peer that died or left ([`PrefixIndex::remove_node`]).

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// Page ids are blake3 output, already uniform: they are their own hash (SipHash over them
/// was most of a lookup's time).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id;
    }
}

type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;
pub(crate) type IdSet = HashSet<u64, BuildHasherDefault<IdHasher>>;

/// The pages of one namespace as routers compute their ids: a tier's (or a store's)
/// namespace, its salt base and its tokens per page. Pages of another base or block size
/// are other pages.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageSpace {
    /// Namespace (the tier).
    pub ns: String,
    /// Salt base (32 bytes).
    pub base: Vec<u8>,
    /// Tokens per page.
    pub block: u32,
}

#[derive(Debug, Default)]
struct Pages {
    /// Short page id → the nodes holding it (indices into `PrefixIndex::names`, sorted).
    holders: IdMap<Vec<u32>>,
    /// Node → the ids it holds here.
    by_node: HashMap<u32, IdSet>,
}

impl Pages {
    fn add(&mut self, node: u32, id: u64) {
        let h = self.holders.entry(id).or_default();
        if let Err(at) = h.binary_search(&node) {
            h.insert(at, node);
        }
    }

    fn drop_holder(&mut self, node: u32, id: u64) {
        if let Some(h) = self.holders.get_mut(&id) {
            h.retain(|n| *n != node);
            if h.is_empty() {
                self.holders.remove(&id);
            }
        }
    }

    /// Makes `ids` the node's whole set here.
    fn set(&mut self, node: u32, ids: IdSet) {
        let old = self.by_node.remove(&node).unwrap_or_default();
        for id in old.difference(&ids) {
            self.drop_holder(node, *id);
        }
        for id in ids.difference(&old) {
            self.add(node, *id);
        }
        if !ids.is_empty() {
            self.by_node.insert(node, ids);
        }
    }
}

/// The index. See the module documentation.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    names: Vec<String>,
    ids: HashMap<String, u32>,
    spaces: HashMap<PageSpace, Pages>,
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    fn intern(&mut self, node: &str) -> u32 {
        if let Some(i) = self.ids.get(node) {
            return *i;
        }
        let i = self.names.len() as u32;
        self.names.push(node.to_owned());
        self.ids.insert(node.to_owned(), i);
        i
    }

    /// Makes `spaces` everything `node` holds: its ids in each space listed (a space listed
    /// twice gets the union), none in any other.
    pub fn set_node<'a>(
        &mut self,
        node: &str,
        spaces: impl IntoIterator<Item = (PageSpace, &'a [u64])>,
    ) {
        let n = self.intern(node);
        let mut wanted: HashMap<PageSpace, IdSet> = HashMap::new();
        for (space, ids) in spaces {
            wanted.entry(space).or_default().extend(ids.iter().copied());
        }
        for (space, pages) in &mut self.spaces {
            if !wanted.contains_key(space) && pages.by_node.contains_key(&n) {
                pages.set(n, IdSet::default());
            }
        }
        for (space, ids) in wanted {
            self.spaces.entry(space).or_default().set(n, ids);
        }
        self.spaces.retain(|_, p| !p.by_node.is_empty());
    }

    /// Adds `stored` to and takes `removed` from what `node` holds in `space` (its page
    /// events), leaving its other spaces as they are.
    pub fn apply(&mut self, node: &str, space: &PageSpace, stored: &[u64], removed: &[u64]) {
        if stored.is_empty() && removed.is_empty() {
            return;
        }
        let n = self.intern(node);
        if !self.spaces.contains_key(space) {
            if stored.is_empty() {
                return;
            }
            self.spaces.insert(space.clone(), Pages::default());
        }
        let pages = self.spaces.get_mut(space).expect("space present");
        let mut mine = pages.by_node.remove(&n).unwrap_or_default();
        for id in removed {
            if mine.remove(id) {
                pages.drop_holder(n, *id);
            }
        }
        for id in stored {
            if mine.insert(*id) {
                pages.add(n, *id);
            }
        }
        if !mine.is_empty() {
            pages.by_node.insert(n, mine);
        } else if pages.by_node.is_empty() {
            self.spaces.remove(space);
        }
    }

    /// Pages `node` is indexed with, over all spaces.
    pub fn count(&self, node: &str) -> usize {
        let Some(n) = self.ids.get(node) else {
            return 0;
        };
        self.spaces
            .values()
            .filter_map(|p| p.by_node.get(n))
            .map(|s| s.len())
            .sum()
    }

    /// Forgets every page of `node` (it died or left).
    pub fn remove_node(&mut self, node: &str) {
        self.set_node(node, std::iter::empty());
    }

    /// For each node holding the first of `ids` in `space`, how many leading ids it holds
    /// (its run), in the order the runs ended (shortest first). Empty when no node holds
    /// the first page.
    pub fn runs(&self, space: &PageSpace, ids: &[u64]) -> Vec<(&str, usize)> {
        let Some(pages) = self.spaces.get(space) else {
            return vec![];
        };
        let Some(first) = ids.first().and_then(|id| pages.holders.get(id)) else {
            return vec![];
        };
        let mut active: Vec<u32> = first.clone();
        let mut out = Vec::with_capacity(active.len());
        for (k, id) in ids.iter().enumerate().skip(1) {
            let holders = pages.holders.get(id).map_or(&[][..], Vec::as_slice);
            active.retain(|n| {
                let still = holders.binary_search(n).is_ok();
                if !still {
                    out.push((self.names[*n as usize].as_str(), k));
                }
                still
            });
            if active.is_empty() {
                return out;
            }
        }
        out.extend(
            active
                .into_iter()
                .map(|n| (self.names[n as usize].as_str(), ids.len())),
        );
        out
    }

    /// Pages indexed over all spaces and nodes (a page two nodes hold counts twice).
    pub fn len(&self) -> usize {
        self.spaces
            .values()
            .flat_map(|p| p.by_node.values())
            .map(|s| s.len())
            .sum()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.spaces.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space(ns: &str) -> PageSpace {
        PageSpace {
            ns: ns.into(),
            base: vec![7; 32],
            block: 16,
        }
    }

    fn runs(ix: &PrefixIndex, s: &PageSpace, ids: &[u64]) -> Vec<(String, usize)> {
        let mut r: Vec<(String, usize)> = ix
            .runs(s, ids)
            .into_iter()
            .map(|(n, k)| (n.to_owned(), k))
            .collect();
        r.sort();
        r
    }

    #[test]
    fn a_nodes_run_is_the_count_of_leading_pages_it_holds() {
        let mut ix = PrefixIndex::new();
        let t1 = space("t1");
        ix.set_node("a", [(t1.clone(), &[1, 2, 3][..])]);
        ix.set_node("b", [(t1.clone(), &[1, 2, 9, 4][..])]);
        ix.set_node("c", [(t1.clone(), &[2, 3, 4][..])]);
        assert_eq!(
            runs(&ix, &t1, &[1, 2, 3, 4]),
            vec![("a".into(), 3), ("b".into(), 2)]
        );
        assert_eq!(runs(&ix, &t1, &[5, 1]), vec![]);
    }

    #[test]
    fn events_add_and_take_pages_of_one_node_only() {
        let mut ix = PrefixIndex::new();
        let t1 = space("t1");
        ix.set_node("a", [(t1.clone(), &[1, 2][..])]);
        ix.set_node("b", [(t1.clone(), &[1, 2][..])]);
        ix.apply("a", &t1, &[3], &[2]);
        assert_eq!(
            runs(&ix, &t1, &[1, 2]),
            vec![("a".into(), 1), ("b".into(), 2)]
        );
        assert_eq!(
            runs(&ix, &t1, &[1, 3]),
            vec![("a".into(), 2), ("b".into(), 1)]
        );
        assert_eq!((ix.count("a"), ix.count("b")), (2, 2));
    }

    #[test]
    fn removing_every_page_of_a_space_by_events_drops_the_space() {
        let mut ix = PrefixIndex::new();
        let t1 = space("t1");
        ix.apply("a", &t1, &[1, 2], &[]);
        ix.apply("a", &t1, &[], &[1, 2, 5]);
        assert!(ix.is_empty());
        assert_eq!(ix.count("a"), 0);
    }

    #[test]
    fn setting_a_node_again_replaces_its_pages() {
        let mut ix = PrefixIndex::new();
        let t1 = space("t1");
        ix.set_node("a", [(t1.clone(), &[1, 2, 3][..])]);
        ix.set_node("a", [(t1.clone(), &[1, 4][..])]);
        assert_eq!(runs(&ix, &t1, &[1, 2]), vec![("a".into(), 1)]);
        assert_eq!(runs(&ix, &t1, &[1, 4]), vec![("a".into(), 2)]);
        assert_eq!(ix.len(), 2);
    }

    #[test]
    fn a_space_the_node_no_longer_lists_is_emptied() {
        let mut ix = PrefixIndex::new();
        let (t1, t2) = (space("t1"), space("t2"));
        ix.set_node("a", [(t1.clone(), &[1][..]), (t2.clone(), &[1][..])]);
        ix.set_node("a", [(t2.clone(), &[1][..])]);
        assert_eq!(runs(&ix, &t1, &[1]), vec![]);
        assert_eq!(runs(&ix, &t2, &[1]), vec![("a".into(), 1)]);
    }

    #[test]
    fn a_space_listed_twice_gets_the_union() {
        let mut ix = PrefixIndex::new();
        let t1 = space("t1");
        ix.set_node("s", [(t1.clone(), &[1][..]), (t1.clone(), &[2][..])]);
        assert_eq!(runs(&ix, &t1, &[1, 2]), vec![("s".into(), 2)]);
    }

    #[test]
    fn another_base_or_block_is_another_space() {
        let mut ix = PrefixIndex::new();
        let t1 = space("t1");
        ix.set_node("a", [(t1.clone(), &[1][..])]);
        let other_block = PageSpace {
            block: 32,
            ..t1.clone()
        };
        let other_base = PageSpace {
            base: vec![8; 32],
            ..t1
        };
        assert_eq!(runs(&ix, &other_block, &[1]), vec![]);
        assert_eq!(runs(&ix, &other_base, &[1]), vec![]);
    }

    #[test]
    fn a_removed_node_holds_nothing_and_the_index_empties() {
        let mut ix = PrefixIndex::new();
        let t1 = space("t1");
        ix.set_node("a", [(t1.clone(), &[1, 2][..])]);
        ix.set_node("b", [(t1.clone(), &[1][..])]);
        ix.remove_node("a");
        assert_eq!(runs(&ix, &t1, &[1, 2]), vec![("b".into(), 1)]);
        ix.remove_node("b");
        assert!(ix.is_empty());
        assert_eq!(ix.len(), 0);
    }
}
