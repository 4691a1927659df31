//! The page store: a RAM tier over an optional far-memory tier and an optional disk tier.
//!
//! ```text
//!   put ─▶ RAM (LRU, byte budget) ──write-through (writer thread)──▶ disk (page files, byte budget)
//!           │ evicted, least recently used first
//!           ▼
//!          far memory (LRU, byte budget; optional) ── evicted ─▶ freed (the disk copy stays)
//!
//!   get ─▶ RAM hit ─▶ checksum ─▶ payload
//!          RAM miss ─▶ far hit ─▶ copy to RAM ─▶ checksum ─▶ promote (leaves far) ─▶ payload
//!                                               corrupt ─▶ refused, counted, freed ─▶ try disk
//!          far miss ─▶ disk hit ─▶ checksum ─▶ promote to RAM ─▶ payload
//!                      corrupt ─▶ refused, counted, file deleted ─▶ miss (caller recomputes)
//! ```
//!
//! A page lives in RAM or in far memory, never both (far memory holds what RAM
//! evicted, so the two budgets add up), and on disk as well when the disk tier is on.
//! Far memory ([`FarMemory`], a CPU-less NUMA node found by the node at start) is
//! optional: without one, or with `far_bytes` 0, pages evicted from RAM are only on
//! disk. A far allocation that fails is counted ([`StoreStats::far_errors`], logged
//! once) and the page stays only on disk.
//!
//! Disk is write-through, so a page evicted from RAM or far memory (least recently
//! used first) is still on disk, and disk pages survive a restart (the folder is indexed at
//! open). When the disk budget is full, the least recently used disk pages are
//! deleted. A failed disk write (disk full, read-only folder) switches the disk
//! tier off, says so once in the log and in [`StoreStats::disk_degraded`], and
//! the store keeps serving from RAM. Every read checks the page checksum, so a
//! damaged page never reaches a model.
//!
//! Locks are held only around map updates, never across file I/O on the read path
//! of another page; the engine thread calls [`PageStore::get`] and
//! [`PageStore::put`] directly.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};

use bytes::Bytes;
use tracing::{info, warn};

use crate::far::FarMemory;
use crate::id::{PageId, Salt};
use crate::page::{self, PageMeta};

/// Store settings.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// RAM tier budget in bytes (pages with headers).
    pub ram_bytes: u64,
    /// Disk tier folder; `None` for RAM only.
    pub disk_dir: Option<PathBuf>,
    /// Disk tier budget in bytes; 0 turns the disk tier off.
    pub disk_bytes: u64,
    /// Far-memory allocator; `None` for no far tier.
    pub far: Option<Arc<dyn FarMemory>>,
    /// Far tier budget in bytes (pages with headers); 0 turns the far tier off.
    pub far_bytes: u64,
}

/// Counters (exported as metrics).
#[derive(Debug, Default)]
pub struct StoreStats {
    /// Pages found in RAM.
    pub hits_ram: AtomicU64,
    /// Pages found in far memory.
    pub hits_far: AtomicU64,
    /// Pages found on disk.
    pub hits_disk: AtomicU64,
    /// Pages asked for and not found.
    pub misses: AtomicU64,
    /// New pages stored.
    pub puts: AtomicU64,
    /// Puts of a page already stored (identical prefix from another sequence).
    pub dedup_pages: AtomicU64,
    /// Bytes not stored again thanks to dedup.
    pub dedup_bytes: AtomicU64,
    /// Pages refused because their checksum or header was wrong.
    pub corrupt: AtomicU64,
    /// Pages evicted from RAM (moved to far memory, and still on disk when the disk tier is on).
    pub evicted_ram: AtomicU64,
    /// Pages evicted from far memory for its budget (still on disk when the disk tier is on).
    pub evicted_far: AtomicU64,
    /// Pages deleted from disk for its budget.
    pub evicted_disk: AtomicU64,
    /// Bytes in RAM.
    pub bytes_ram: AtomicU64,
    /// Bytes in far memory.
    pub bytes_far: AtomicU64,
    /// Bytes on disk.
    pub bytes_disk: AtomicU64,
    /// Pages in RAM.
    pub pages_ram: AtomicU64,
    /// Pages in far memory.
    pub pages_far: AtomicU64,
    /// Pages on disk.
    pub pages_disk: AtomicU64,
    /// Disk write/read errors.
    pub disk_errors: AtomicU64,
    /// Far-memory allocations that failed (those pages were kept only on disk).
    pub far_errors: AtomicU64,
    /// Pages fetched from peers and stored here.
    pub fetched_from_peers: AtomicU64,
    /// Bytes of those pages.
    pub fetched_bytes: AtomicU64,
    /// 1 when the disk tier was switched off after an error.
    pub disk_degraded: AtomicU64,
}

/// Ids a level stored or removed since the store's last [`PageStore::take_changes`]; past
/// [`TOUCHED_CAP`] it stops counting and the next take lists everything held.
#[derive(Default)]
struct Touched {
    ids: Vec<PageId>,
    overflow: bool,
}

/// Most ids a level remembers between two takes (a node not in a cluster never takes).
const TOUCHED_CAP: usize = 1 << 16;

impl Touched {
    fn note(&mut self, id: PageId) {
        if self.overflow {
            return;
        }
        if self.ids.len() >= TOUCHED_CAP {
            self.overflow = true;
            self.ids = Vec::new();
        } else {
            self.ids.push(id);
        }
    }
}

/// What a page weighs against a level's byte budget: RAM and far memory hold the page's
/// bytes, the disk index only its size.
trait Weighed: Clone {
    fn weight(&self) -> u64;
}

impl Weighed for Bytes {
    fn weight(&self) -> u64 {
        self.len() as u64
    }
}

impl Weighed for u64 {
    fn weight(&self) -> u64 {
        *self
    }
}

/// One level's eviction policy, least recently used first, for every level of the store:
/// page id → (value, last use), with the byte total the budgets check and the ids changed
/// since the last [`PageStore::take_changes`].
#[derive(Default)]
struct Lru<V> {
    map: HashMap<PageId, (V, u64)>,
    order: BTreeMap<u64, PageId>,
    bytes: u64,
    tick: u64,
    touched: Touched,
}

impl<V: Weighed> Lru<V> {
    /// Marks `id` used now; its value, if held.
    fn touch(&mut self, id: &PageId) -> Option<V> {
        self.tick += 1;
        let tick = self.tick;
        let (v, t) = self.map.get_mut(id)?;
        self.order.remove(t);
        *t = tick;
        self.order.insert(tick, *id);
        Some(v.clone())
    }
    fn insert(&mut self, id: PageId, v: V) {
        self.tick += 1;
        self.touched.note(id);
        self.bytes += v.weight();
        if let Some((old, t)) = self.map.insert(id, (v, self.tick)) {
            self.bytes -= old.weight();
            self.order.remove(&t);
        }
        self.order.insert(self.tick, id);
    }
    fn remove(&mut self, id: &PageId) -> Option<V> {
        let (v, t) = self.map.remove(id)?;
        self.touched.note(*id);
        self.order.remove(&t);
        self.bytes -= v.weight();
        Some(v)
    }
    /// Inserts, then evicts least recently used pages until `budget` holds; returns them.
    fn insert_within(&mut self, id: PageId, v: V, budget: u64) -> Vec<(PageId, V)> {
        self.insert(id, v);
        self.evict_to(budget)
    }
    /// Evicts least recently used pages until `budget` holds; returns them.
    fn evict_to(&mut self, budget: u64) -> Vec<(PageId, V)> {
        let mut out = vec![];
        while self.bytes > budget {
            match self.pop_oldest() {
                Some(v) => out.push(v),
                None => break,
            }
        }
        out
    }
    fn pop_oldest(&mut self) -> Option<(PageId, V)> {
        let (&t, &id) = self.order.iter().next()?;
        self.order.remove(&t);
        let (v, _) = self.map.remove(&id)?;
        self.touched.note(id);
        self.bytes -= v.weight();
        Some((id, v))
    }
}

/// Disk tier index: page id → (size, last use); the bytes live in files.
type DiskIndex = Lru<u64>;

struct Disk {
    dir: PathBuf,
    budget: u64,
    index: Mutex<DiskIndex>,
    degraded: AtomicBool,
}

impl Disk {
    fn path(&self, id: &PageId) -> PathBuf {
        self.dir.join(format!("{}.page", id.to_hex()))
    }
}

struct Far {
    mem: Arc<dyn FarMemory>,
    budget: u64,
    lru: Mutex<Lru<Bytes>>,
    warned: AtomicBool,
}

/// What a store's levels changed since the last [`PageStore::take_changes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changes {
    /// Ids stored or removed, each with whether the store holds it now.
    Touched(Vec<(PageId, bool)>),
    /// Every id held (a level lost count of its changes).
    All(Vec<PageId>),
}

/// Takes the pages a store lets go of and would otherwise lose (evicted from RAM or far
/// memory with no disk copy): a node with a store peer demotes them there.
pub trait EvictSink: Send + Sync + std::fmt::Debug {
    /// `stored` is the page's stored form (header + payload).
    fn evicted(&self, id: PageId, stored: Bytes);
}

/// A tiered page store. Cheap to share (`Arc`).
pub struct PageStore {
    ram_budget: u64,
    sink: Mutex<Option<Arc<dyn EvictSink>>>,
    ram: Mutex<Lru<Bytes>>,
    far: Option<Far>,
    disk: Option<Arc<Disk>>,
    writer: Mutex<Option<mpsc::Sender<(PageId, Bytes)>>>,
    writer_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    stats: Arc<StoreStats>,
}

impl std::fmt::Debug for PageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageStore")
            .field("ram_budget", &self.ram_budget)
            .field("far", &self.far.as_ref().map(|f| (f.mem.nodes(), f.budget)))
            .field("disk", &self.disk.as_ref().map(|d| d.dir.clone()))
            .finish()
    }
}

fn degrade(disk: &Disk, stats: &StoreStats, what: &str, e: &std::io::Error) {
    stats.disk_errors.fetch_add(1, Relaxed);
    if !disk.degraded.swap(true, Relaxed) {
        stats.disk_degraded.store(1, Relaxed);
        warn!(dir = %disk.dir.display(), error = %e, "{what} failed; KV page disk tier off, serving from RAM");
    }
}

impl PageStore {
    /// Opens the store; indexes pages already in the disk folder (from an earlier run).
    /// A disk folder that cannot be created or written leaves the store RAM-only
    /// (degraded), never fails.
    pub fn open(cfg: StoreConfig) -> Self {
        let stats = Arc::new(StoreStats::default());
        let disk = match (&cfg.disk_dir, cfg.disk_bytes) {
            (Some(dir), b) if b > 0 => {
                let d = Arc::new(Disk {
                    dir: dir.clone(),
                    budget: b,
                    index: Mutex::new(DiskIndex::default()),
                    degraded: AtomicBool::new(false),
                });
                let probe = dir.join(".mesh-probe");
                let ok = std::fs::create_dir_all(dir)
                    .and_then(|_| std::fs::write(&probe, b"ok"))
                    .and_then(|_| std::fs::remove_file(&probe));
                if let Err(e) = ok {
                    degrade(&d, &stats, "opening the page folder", &e);
                } else {
                    let mut found: Vec<(std::time::SystemTime, PageId, u64)> =
                        std::fs::read_dir(dir)
                            .into_iter()
                            .flatten()
                            .flatten()
                            .filter_map(|e| {
                                let name = e.file_name().into_string().ok()?;
                                let id = PageId::from_hex(name.strip_suffix(".page")?)?;
                                let md = e.metadata().ok()?;
                                Some((md.modified().ok()?, id, md.len()))
                            })
                            .collect();
                    found.sort();
                    let mut idx = d.index.lock().expect("disk index");
                    for (_, id, len) in &found {
                        idx.insert(*id, *len);
                    }
                    stats.pages_disk.store(idx.map.len() as u64, Relaxed);
                    stats.bytes_disk.store(idx.bytes, Relaxed);
                    if !found.is_empty() {
                        info!(dir = %dir.display(), pages = found.len(), bytes = idx.bytes, "KV pages found on disk");
                    }
                }
                Some(d)
            }
            _ => None,
        };
        let (writer, writer_thread) = match &disk {
            Some(d) => {
                let (tx, rx) = mpsc::channel::<(PageId, Bytes)>();
                let (d, st) = (d.clone(), stats.clone());
                let h = std::thread::Builder::new()
                    .name("kv-page-writer".into())
                    .spawn(move || {
                        for (id, bytes) in rx {
                            write_page(&d, &st, id, &bytes);
                        }
                    })
                    .expect("spawn page writer");
                (Some(tx), Some(h))
            }
            None => (None, None),
        };
        let far = match cfg.far {
            Some(mem) if cfg.far_bytes > 0 => Some(Far {
                mem,
                budget: cfg.far_bytes,
                lru: Mutex::new(Lru::default()),
                warned: AtomicBool::new(false),
            }),
            _ => None,
        };
        Self {
            ram_budget: cfg.ram_bytes,
            sink: Mutex::new(None),
            ram: Mutex::new(Lru::default()),
            far,
            disk,
            writer: Mutex::new(writer),
            writer_thread: Mutex::new(writer_thread),
            stats,
        }
    }

    /// Hands pages this store would lose (evicted with no far or disk copy) to `sink`.
    pub fn set_evict_sink(&self, sink: Arc<dyn EvictSink>) {
        *self.sink.lock().expect("sink") = Some(sink);
    }

    /// Whether pages evicted from RAM are lost here (no far memory, no working disk tier).
    fn loses(&self) -> bool {
        self.disk.as_ref().is_none_or(|d| d.degraded.load(Relaxed))
    }

    fn lost(&self, pages: Vec<(PageId, Bytes)>) {
        if pages.is_empty() || !self.loses() {
            return;
        }
        let sink = self.sink.lock().expect("sink").clone();
        if let Some(sink) = sink {
            for (id, b) in pages {
                sink.evicted(id, b);
            }
        }
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<StoreStats> {
        &self.stats
    }

    /// NUMA nodes of the far-memory tier; `None` when the store has no far tier.
    pub fn far_nodes(&self) -> Option<Vec<u32>> {
        self.far.as_ref().map(|f| f.mem.nodes())
    }

    /// Whether `id` is in the RAM tier (a read of it touches no file).
    pub fn in_ram(&self, id: &PageId) -> bool {
        self.ram.lock().expect("ram").map.contains_key(id)
    }

    /// Whether `id` is stored in any tier (no checksum check).
    pub fn contains(&self, id: &PageId) -> bool {
        self.ram.lock().expect("ram").map.contains_key(id)
            || self
                .far
                .as_ref()
                .is_some_and(|f| f.lru.lock().expect("far").map.contains_key(id))
            || self
                .disk
                .as_ref()
                .is_some_and(|d| d.index.lock().expect("disk index").map.contains_key(id))
    }

    /// What changed since the last call: each id stored or removed at any level with
    /// whether the store holds it now, or everything held when a level lost count (more
    /// than [`TOUCHED_CAP`] changes since the last call). The page-store actor takes them
    /// every heartbeat period for the node's page events ([`crate::PageLog`]).
    pub fn take_changes(&self) -> Changes {
        let mut ids = vec![];
        let mut overflow = false;
        let mut take = |t: &mut Touched| {
            overflow |= std::mem::take(&mut t.overflow);
            ids.append(&mut t.ids);
        };
        take(&mut self.ram.lock().expect("ram").touched);
        if let Some(f) = &self.far {
            take(&mut f.lru.lock().expect("far").touched);
        }
        if let Some(d) = &self.disk {
            take(&mut d.index.lock().expect("disk index").touched);
        }
        if overflow {
            return Changes::All(self.held_ids());
        }
        ids.sort_unstable();
        ids.dedup();
        Changes::Touched(ids.into_iter().map(|id| (id, self.contains(&id))).collect())
    }

    /// Every id held at any level.
    pub fn held_ids(&self) -> Vec<PageId> {
        let mut out: Vec<PageId> = self.ram.lock().expect("ram").map.keys().copied().collect();
        if let Some(f) = &self.far {
            out.extend(f.lru.lock().expect("far").map.keys().copied());
        }
        if let Some(d) = &self.disk {
            out.extend(d.index.lock().expect("disk index").map.keys().copied());
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The payload of page `id` in namespace `salt`, or `None` (missing or refused as corrupt).
    pub fn get(&self, id: &PageId, salt: &Salt) -> Option<Bytes> {
        let in_ram = self.ram.lock().expect("ram").touch(id);
        if let Some(b) = in_ram {
            match page::decode(&b, id, salt) {
                Ok((_, payload)) => {
                    self.stats.hits_ram.fetch_add(1, Relaxed);
                    return Some(payload);
                }
                Err(e) => {
                    self.refuse(id, &e.to_string());
                    return None;
                }
            }
        }
        if let Some(f) = &self.far {
            let taken = {
                let mut lru = f.lru.lock().expect("far");
                let b = lru.remove(id);
                self.stats.bytes_far.store(lru.bytes, Relaxed);
                self.stats.pages_far.store(lru.map.len() as u64, Relaxed);
                b
            };
            if let Some(far_copy) = taken {
                // Check the copy that will be served, then free the far one.
                let bytes = Bytes::copy_from_slice(&far_copy);
                drop(far_copy);
                match page::decode(&bytes, id, salt) {
                    Ok((_, payload)) => {
                        self.stats.hits_far.fetch_add(1, Relaxed);
                        self.insert_ram(*id, bytes);
                        return Some(payload);
                    }
                    Err(e) => {
                        // The disk copy, if any, is checked on its own below.
                        warn!(page = %id, reason = %e, "refused a corrupt KV page from far memory");
                        self.stats.corrupt.fetch_add(1, Relaxed);
                    }
                }
            }
        }
        let Some(d) = &self.disk else {
            self.stats.misses.fetch_add(1, Relaxed);
            return None;
        };
        if d.index.lock().expect("disk index").touch(id).is_none() {
            self.stats.misses.fetch_add(1, Relaxed);
            return None;
        }
        let bytes = match std::fs::read(d.path(id)) {
            Ok(b) => Bytes::from(b),
            Err(e) => {
                warn!(page = %id, error = %e, "reading a KV page failed");
                self.stats.disk_errors.fetch_add(1, Relaxed);
                self.forget_disk(id);
                self.stats.misses.fetch_add(1, Relaxed);
                return None;
            }
        };
        match page::decode(&bytes, id, salt) {
            Ok((_, payload)) => {
                self.stats.hits_disk.fetch_add(1, Relaxed);
                self.insert_ram(*id, bytes);
                Some(payload)
            }
            Err(e) => {
                self.refuse(id, &e.to_string());
                None
            }
        }
    }

    /// Consecutive pages of `ids` from the first, stopping at the first missing one.
    pub fn longest_prefix(&self, ids: &[PageId], salt: &Salt) -> Vec<Bytes> {
        let mut out = vec![];
        for id in ids {
            match self.get(id, salt) {
                Some(p) => out.push(p),
                None => break,
            }
        }
        out
    }

    /// Stores a page; returns false if it was already stored (deduplicated).
    pub fn put(&self, meta: &PageMeta, payload: &[u8]) -> bool {
        if self.contains(&meta.id) {
            self.stats.dedup_pages.fetch_add(1, Relaxed);
            self.stats
                .dedup_bytes
                .fetch_add((payload.len() + page::HEADER_LEN) as u64, Relaxed);
            return false;
        }
        let bytes = page::encode(meta, payload);
        self.stats.puts.fetch_add(1, Relaxed);
        self.insert_ram(meta.id, bytes.clone());
        if let Some(d) = &self.disk {
            if !d.degraded.load(Relaxed) {
                if let Some(tx) = self.writer.lock().expect("writer").as_ref() {
                    let _ = tx.send((meta.id, bytes));
                }
            }
        }
        true
    }

    /// The stored form (header + payload) of a page, checked, for sending to a peer.
    pub fn get_stored(&self, id: &PageId, salt: &Salt) -> Option<Bytes> {
        self.get(id, salt)?;
        if let Some(b) = self
            .ram
            .lock()
            .expect("ram")
            .map
            .get(id)
            .map(|(b, _)| b.clone())
        {
            return Some(b);
        }
        None
    }

    /// Stores a page a peer demoted here in its stored form, checked against its own header
    /// (id and checksum; the salt is the one it carries): a store node keeps any namespace's
    /// pages, and whoever fetches one checks it against the salt it expects.
    pub fn put_demoted(&self, id: &PageId, stored: Bytes) -> bool {
        match page::salt_of(&stored) {
            Some(salt) => self.put_fetched(id, &salt, stored),
            None => {
                self.stats.corrupt.fetch_add(1, Relaxed);
                false
            }
        }
    }

    /// Stores a page received from a peer in its stored form; refuses (and counts) one
    /// whose header or checksum does not match `id` and `salt`.
    pub fn put_fetched(&self, id: &PageId, salt: &Salt, stored: Bytes) -> bool {
        match page::decode(&stored, id, salt) {
            Ok((meta, payload)) => {
                let n = stored.len() as u64;
                if self.put(&meta, &payload) {
                    self.stats.fetched_from_peers.fetch_add(1, Relaxed);
                    self.stats.fetched_bytes.fetch_add(n, Relaxed);
                }
                true
            }
            Err(e) => {
                warn!(page = %id, error = %e, "refused a page from a peer");
                self.stats.corrupt.fetch_add(1, Relaxed);
                false
            }
        }
    }

    /// Ids of up to `limit` pages held, most recently used first (RAM, then far memory,
    /// then disk).
    pub fn recent_ids(&self, limit: usize) -> Vec<PageId> {
        let mut out: Vec<PageId> = self
            .ram
            .lock()
            .expect("ram")
            .order
            .values()
            .rev()
            .take(limit)
            .copied()
            .collect();
        if let Some(f) = self.far.as_ref().filter(|_| out.len() < limit) {
            // RAM and far memory never hold the same page.
            let lru = f.lru.lock().expect("far");
            out.extend(lru.order.values().rev().take(limit - out.len()).copied());
        }
        if out.len() < limit {
            if let Some(d) = &self.disk {
                let idx = d.index.lock().expect("disk index");
                let seen: std::collections::HashSet<PageId> = out.iter().copied().collect();
                out.extend(
                    idx.order
                        .values()
                        .rev()
                        .filter(|id| !seen.contains(id))
                        .take(limit - out.len())
                        .copied(),
                );
            }
        }
        out
    }

    /// Counts a page that was not stored again because an identical one is
    /// (`payload_bytes` without the header).
    pub fn note_dedup(&self, payload_bytes: usize) {
        self.stats.dedup_pages.fetch_add(1, Relaxed);
        self.stats
            .dedup_bytes
            .fetch_add((payload_bytes + page::HEADER_LEN) as u64, Relaxed);
    }

    /// Waits until pages handed to the disk writer are on disk.
    pub fn flush(&self) {
        let tx = self.writer.lock().expect("writer").take();
        drop(tx);
        if let Some(h) = self.writer_thread.lock().expect("writer thread").take() {
            let _ = h.join();
        }
        // Reopen a writer so the store keeps working after a flush.
        if let Some(d) = &self.disk {
            let (tx, rx) = mpsc::channel::<(PageId, Bytes)>();
            let (d, st) = (d.clone(), self.stats.clone());
            let h = std::thread::spawn(move || {
                for (id, bytes) in rx {
                    write_page(&d, &st, id, &bytes);
                }
            });
            *self.writer.lock().expect("writer") = Some(tx);
            *self.writer_thread.lock().expect("writer thread") = Some(h);
        }
    }

    fn insert_ram(&self, id: PageId, bytes: Bytes) {
        let evicted = {
            let mut ram = self.ram.lock().expect("ram");
            let out = ram.insert_within(id, bytes, self.ram_budget);
            self.stats.evicted_ram.fetch_add(out.len() as u64, Relaxed);
            self.stats.bytes_ram.store(ram.bytes, Relaxed);
            self.stats.pages_ram.store(ram.map.len() as u64, Relaxed);
            out
        };
        // Copied into far memory outside the RAM lock: reads of other pages do not wait.
        match &self.far {
            Some(f) => {
                for (id, bytes) in evicted {
                    self.demote_far(f, id, &bytes);
                }
            }
            None => self.lost(evicted),
        }
    }

    fn demote_far(&self, f: &Far, id: PageId, page: &[u8]) {
        if page.len() as u64 > f.budget {
            return;
        }
        let far_copy = match f.mem.copy_in(page) {
            Ok(b) => b,
            Err(e) => {
                self.stats.far_errors.fetch_add(1, Relaxed);
                if !f.warned.swap(true, Relaxed) {
                    warn!(nodes = ?f.mem.nodes(), error = %e, "far memory refused a KV page; such pages are kept only on disk (logged once)");
                }
                return;
            }
        };
        let freed = {
            let mut lru = f.lru.lock().expect("far");
            let out = lru.insert_within(id, far_copy, f.budget);
            self.stats.evicted_far.fetch_add(out.len() as u64, Relaxed);
            self.stats.bytes_far.store(lru.bytes, Relaxed);
            self.stats.pages_far.store(lru.map.len() as u64, Relaxed);
            out
        };
        // Far memory is returned to the OS outside the lock (a copy goes to the sink when
        // nothing else keeps the page).
        if self.loses() && self.sink.lock().expect("sink").is_some() {
            let copies = freed
                .iter()
                .map(|(id, b)| (*id, Bytes::copy_from_slice(b)))
                .collect();
            drop(freed);
            self.lost(copies);
        } else {
            drop(freed);
        }
    }

    fn forget_disk(&self, id: &PageId) {
        if let Some(d) = &self.disk {
            let mut idx = d.index.lock().expect("disk index");
            idx.remove(id);
            self.stats.pages_disk.store(idx.map.len() as u64, Relaxed);
            self.stats.bytes_disk.store(idx.bytes, Relaxed);
        }
    }

    fn refuse(&self, id: &PageId, why: &str) {
        warn!(page = %id, reason = %why, "refused a corrupt KV page; the prefix will be recomputed");
        self.stats.corrupt.fetch_add(1, Relaxed);
        self.stats.misses.fetch_add(1, Relaxed);
        {
            let mut ram = self.ram.lock().expect("ram");
            ram.remove(id);
            self.stats.bytes_ram.store(ram.bytes, Relaxed);
            self.stats.pages_ram.store(ram.map.len() as u64, Relaxed);
        }
        if let Some(d) = &self.disk {
            let _ = std::fs::remove_file(d.path(id));
        }
        self.forget_disk(id);
    }
}

fn write_page(d: &Disk, st: &StoreStats, id: PageId, bytes: &[u8]) {
    if d.degraded.load(Relaxed) {
        return;
    }
    let size = bytes.len() as u64;
    // Make room under the budget, least recently used first.
    let victims = d
        .index
        .lock()
        .expect("disk index")
        .evict_to(d.budget.saturating_sub(size));
    for (v, _) in &victims {
        let _ = std::fs::remove_file(d.path(v));
        st.evicted_disk.fetch_add(1, Relaxed);
    }
    if size > d.budget {
        return;
    }
    let path = d.path(&id);
    let tmp = path.with_extension("tmp");
    let res = std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, &path));
    match res {
        Ok(()) => {
            let mut idx = d.index.lock().expect("disk index");
            idx.insert(id, size);
            st.pages_disk.store(idx.map.len() as u64, Relaxed);
            st.bytes_disk.store(idx.bytes, Relaxed);
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            degrade(d, st, "writing a KV page", &e);
        }
    }
}

impl Drop for PageStore {
    fn drop(&mut self) {
        // Let queued pages reach the disk.
        drop(self.writer.lock().expect("writer").take());
        if let Some(h) = self.writer_thread.lock().expect("writer thread").take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::far::FarMemoryError;
    use crate::id::PageId;

    /// Far memory on the ordinary heap; can damage the next page it takes, or refuse.
    #[derive(Debug, Default)]
    struct HeapFar {
        corrupt_next: AtomicBool,
        fail: AtomicBool,
    }

    impl FarMemory for HeapFar {
        fn copy_in(&self, page: &[u8]) -> Result<Bytes, FarMemoryError> {
            if self.fail.load(Relaxed) {
                return Err(FarMemoryError::Allocation {
                    bytes: page.len(),
                    reason: "node full".into(),
                });
            }
            let mut v = page.to_vec();
            if self.corrupt_next.swap(false, Relaxed) {
                let n = v.len();
                v[n - 1] ^= 0xFF;
            }
            Ok(Bytes::from(v))
        }

        fn nodes(&self) -> Vec<u32> {
            vec![2]
        }
    }

    const PAGE: usize = 100;
    const PAGE_LEN: u64 = (page::HEADER_LEN + PAGE) as u64;

    /// A store holding `ram` pages in RAM and `far` in far memory, with a disk tier when
    /// `disk` is given.
    fn tiered(ram: u64, far: u64, disk: Option<&std::path::Path>, mem: &Arc<HeapFar>) -> PageStore {
        PageStore::open(StoreConfig {
            ram_bytes: ram * PAGE_LEN,
            disk_dir: disk.map(Into::into),
            disk_bytes: if disk.is_some() { 1 << 20 } else { 0 },
            far: Some(mem.clone()),
            far_bytes: far * PAGE_LEN,
        })
    }

    fn get(s: &PageStore, i: u8) -> Option<Bytes> {
        s.get(&meta(i).id, &meta(i).salt)
    }

    fn far_ids(s: &PageStore) -> Vec<u8> {
        let f = s.far.as_ref().unwrap().lru.lock().unwrap();
        f.order.values().map(|id| id.0[0]).collect()
    }

    #[test]
    fn demotion_goes_ram_then_far_then_disk() {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(HeapFar::default());
        let s = tiered(2, 2, Some(dir.path()), &mem);
        assert_eq!(s.far_nodes(), Some(vec![2]));
        for i in 0..5 {
            assert!(s.put(&meta(i), &[i; PAGE]));
        }
        s.flush();
        // RAM keeps the newest two, far memory the two before, page 0 is only on disk.
        assert_eq!(far_ids(&s), vec![1, 2]);
        let st = s.stats();
        assert_eq!(st.evicted_ram.load(Relaxed), 3);
        assert_eq!(st.evicted_far.load(Relaxed), 1);
        assert_eq!(st.pages_ram.load(Relaxed), 2);
        assert_eq!(st.pages_far.load(Relaxed), 2);
        assert_eq!(st.bytes_far.load(Relaxed), 2 * PAGE_LEN);
        assert_eq!(st.pages_disk.load(Relaxed), 5);
        assert!(s.contains(&meta(0).id) && s.contains(&meta(1).id));
        // Most recent first: RAM (4, 3), far memory (2, 1), disk (0).
        let order: Vec<u8> = s.recent_ids(10).iter().map(|id| id.0[0]).collect();
        assert_eq!(order, vec![4, 3, 2, 1, 0]);
        // A far hit comes back to RAM and leaves far memory; RAM's oldest (3) goes there.
        assert_eq!(get(&s, 1).unwrap()[..], [1u8; PAGE][..]);
        assert_eq!(st.hits_far.load(Relaxed), 1);
        assert_eq!(far_ids(&s), vec![2, 3]);
        assert_eq!(st.pages_far.load(Relaxed), 2);
        // Page 0 comes from disk and pushes 4 into far memory, evicting 2 from it.
        assert_eq!(get(&s, 0).unwrap()[..], [0u8; PAGE][..]);
        assert_eq!(st.hits_disk.load(Relaxed), 1);
        assert_eq!(far_ids(&s), vec![3, 4]);
        assert_eq!(st.evicted_far.load(Relaxed), 2);
        assert_eq!(st.hits_ram.load(Relaxed), 0);
        assert_eq!(get(&s, 2).unwrap()[..], [2u8; PAGE][..]);
        assert_eq!(st.hits_disk.load(Relaxed), 2);
    }

    #[test]
    fn far_hit_is_promoted_without_a_disk_tier() {
        let mem = Arc::new(HeapFar::default());
        let s = tiered(1, 2, None, &mem);
        for i in 0..3 {
            s.put(&meta(i), &[i; PAGE]);
        }
        assert_eq!(far_ids(&s), vec![0, 1]);
        assert_eq!(get(&s, 0).unwrap()[..], [0u8; PAGE][..]);
        assert_eq!(s.stats().hits_far.load(Relaxed), 1);
        // Served again from RAM: the promotion stuck.
        assert_eq!(get(&s, 0).unwrap()[..], [0u8; PAGE][..]);
        assert_eq!(s.stats().hits_ram.load(Relaxed), 1);
        assert_eq!(far_ids(&s), vec![1, 2]);
        // A put pushes 0 down; far memory is full and drops 1, which no tier holds now.
        s.put(&meta(3), &[3; PAGE]);
        assert_eq!(far_ids(&s), vec![2, 0]);
        assert!(!s.contains(&meta(1).id));
        assert!(get(&s, 1).is_none());
        assert_eq!(s.stats().misses.load(Relaxed), 1);
        // Put again after the far copy is gone: stored, not deduplicated.
        assert!(s.put(&meta(1), &[1; PAGE]));
    }

    #[test]
    fn corrupt_far_page_is_refused_and_counted() {
        // Without disk: refused, counted, gone.
        let mem = Arc::new(HeapFar::default());
        let s = tiered(1, 4, None, &mem);
        s.put(&meta(0), &[0; PAGE]);
        mem.corrupt_next.store(true, Relaxed);
        s.put(&meta(1), &[1; PAGE]); // demotes page 0, damaged on the way
        assert!(get(&s, 0).is_none());
        assert_eq!(s.stats().corrupt.load(Relaxed), 1);
        assert_eq!(s.stats().misses.load(Relaxed), 1);
        assert_eq!(s.stats().hits_far.load(Relaxed), 0);
        assert!(!s.contains(&meta(0).id));
        assert_eq!(s.stats().pages_far.load(Relaxed), 0);

        // With disk: the far copy is refused and the intact disk copy served.
        let dir = tempfile::tempdir().unwrap();
        let s = tiered(1, 4, Some(dir.path()), &mem);
        s.put(&meta(0), &[0; PAGE]);
        mem.corrupt_next.store(true, Relaxed);
        s.put(&meta(1), &[1; PAGE]);
        s.flush();
        assert_eq!(get(&s, 0).unwrap()[..], [0u8; PAGE][..]);
        assert_eq!(s.stats().corrupt.load(Relaxed), 1);
        assert_eq!(s.stats().hits_disk.load(Relaxed), 1);
        assert_eq!(s.stats().hits_far.load(Relaxed), 0);
    }

    #[test]
    fn far_budget_zero_or_failing_allocator_leaves_ram_and_disk() {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(HeapFar::default());
        // Budget 0: no far tier even with an allocator.
        let s = tiered(1, 0, Some(dir.path()), &mem);
        assert_eq!(s.far_nodes(), None);
        s.put(&meta(0), &[0; PAGE]);
        s.put(&meta(1), &[1; PAGE]);
        s.flush();
        assert_eq!(s.stats().pages_far.load(Relaxed), 0);
        assert_eq!(get(&s, 0).unwrap()[..], [0u8; PAGE][..]);
        assert_eq!(s.stats().hits_disk.load(Relaxed), 1);
        drop(s);

        // An allocator that refuses: counted, the page stays on disk.
        let dir = tempfile::tempdir().unwrap();
        mem.fail.store(true, Relaxed);
        let s = tiered(1, 4, Some(dir.path()), &mem);
        s.put(&meta(0), &[0; PAGE]);
        s.put(&meta(1), &[1; PAGE]);
        s.put(&meta(2), &[2; PAGE]);
        s.flush();
        assert_eq!(s.stats().far_errors.load(Relaxed), 2);
        assert_eq!(s.stats().pages_far.load(Relaxed), 0);
        assert_eq!(get(&s, 0).unwrap()[..], [0u8; PAGE][..]);
        assert_eq!(s.stats().hits_disk.load(Relaxed), 1);
    }

    fn meta(i: u8) -> PageMeta {
        PageMeta {
            id: PageId([i; 32]),
            salt: Salt([7; 32]),
            block: 4,
            index: 0,
        }
    }

    fn ram_only(pages: u64) -> PageStore {
        PageStore::open(StoreConfig {
            ram_bytes: pages * (page::HEADER_LEN + 1000) as u64,
            disk_dir: None,
            disk_bytes: 0,
            far: None,
            far_bytes: 0,
        })
    }

    #[test]
    fn changes_list_stored_pages_as_held() {
        let s = ram_only(4);
        s.put(&meta(1), &[1; 1000]);
        s.put(&meta(2), &[2; 1000]);
        assert_eq!(
            s.take_changes(),
            Changes::Touched(vec![(meta(1).id, true), (meta(2).id, true)])
        );
        assert_eq!(s.take_changes(), Changes::Touched(vec![]));
    }

    #[test]
    fn a_page_evicted_with_no_other_copy_is_a_change_to_not_held() {
        let s = ram_only(2);
        for i in 0..3 {
            s.put(&meta(i), &[i; 1000]);
        }
        let Changes::Touched(c) = s.take_changes() else {
            panic!("counted")
        };
        assert_eq!(c[0], (meta(0).id, false));
    }

    #[test]
    fn a_page_moving_from_ram_to_disk_stays_held() {
        let dir = tempfile::tempdir().unwrap();
        let s = PageStore::open(StoreConfig {
            ram_bytes: (page::HEADER_LEN + 1000) as u64,
            disk_dir: Some(dir.path().into()),
            disk_bytes: 1 << 20,
            far: None,
            far_bytes: 0,
        });
        s.put(&meta(0), &[0; 1000]);
        s.put(&meta(1), &[1; 1000]);
        s.flush();
        assert_eq!(
            s.take_changes(),
            Changes::Touched(vec![(meta(0).id, true), (meta(1).id, true)])
        );
    }

    #[test]
    fn a_corrupt_page_refused_is_a_change_to_not_held() {
        let s = ram_only(4);
        s.put(&meta(3), &[3; 1000]);
        s.take_changes();
        // Read with a salt of another namespace is a miss, not a refusal: corrupt it.
        {
            let mut ram = s.ram.lock().unwrap();
            let (b, _) = ram.map.get_mut(&meta(3).id).unwrap();
            let mut v = b.to_vec();
            let last = v.len() - 1;
            v[last] ^= 0xff;
            *b = Bytes::from(v);
        }
        assert!(s.get(&meta(3).id, &meta(3).salt).is_none());
        assert_eq!(
            s.take_changes(),
            Changes::Touched(vec![(meta(3).id, false)])
        );
    }

    #[test]
    fn a_level_that_lost_count_lists_everything_held() {
        let s = ram_only(4);
        s.put(&meta(1), &[1; 1000]);
        s.ram.lock().unwrap().touched.overflow = true;
        assert_eq!(s.take_changes(), Changes::All(vec![meta(1).id]));
    }

    #[test]
    fn ram_lru_evicts_oldest_and_disk_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let page_len = (page::HEADER_LEN + 1000) as u64;
        let s = PageStore::open(StoreConfig {
            ram_bytes: 2 * page_len,
            disk_dir: Some(dir.path().into()),
            disk_bytes: 1 << 20,
            far: None,
            far_bytes: 0,
        });
        for i in 0..3 {
            assert!(s.put(&meta(i), &[i; 1000]));
        }
        // Identical page again: deduplicated.
        assert!(!s.put(&meta(1), &[1; 1000]));
        assert_eq!(s.stats().dedup_pages.load(Relaxed), 1);
        assert_eq!(s.stats().evicted_ram.load(Relaxed), 1);
        s.flush();
        // Page 0 left RAM but comes back from disk (promoted).
        assert_eq!(
            s.get(&meta(0).id, &meta(0).salt).unwrap()[..],
            [0u8; 1000][..]
        );
        assert_eq!(s.stats().hits_disk.load(Relaxed), 1);
        assert!(s.get(&meta(2).id, &meta(2).salt).is_some());
        // Wrong namespace: not served.
        assert!(s.get(&meta(2).id, &Salt([0; 32])).is_none());
        assert!(s.get(&PageId([99; 32]), &meta(0).salt).is_none());
    }

    #[test]
    fn pages_survive_reopen_and_corruption_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = StoreConfig {
            ram_bytes: 1 << 20,
            disk_dir: Some(dir.path().into()),
            disk_bytes: 1 << 20,
            far: None,
            far_bytes: 0,
        };
        {
            let s = PageStore::open(cfg.clone());
            s.put(&meta(1), &[1; 100]);
            s.put(&meta(2), &[2; 100]);
        }
        let s = PageStore::open(cfg.clone());
        assert_eq!(s.stats().pages_disk.load(Relaxed), 2);
        assert_eq!(
            s.get(&meta(1).id, &meta(1).salt).unwrap()[..],
            [1u8; 100][..]
        );
        // Flip a payload byte of page 2 on disk.
        let p = dir.path().join(format!("{}.page", meta(2).id.to_hex()));
        let mut b = std::fs::read(&p).unwrap();
        let n = b.len();
        b[n - 5] ^= 0xFF;
        std::fs::write(&p, b).unwrap();
        assert!(s.get(&meta(2).id, &meta(2).salt).is_none());
        assert_eq!(s.stats().corrupt.load(Relaxed), 1);
        assert!(!p.exists(), "corrupt page deleted");
        assert!(!s.contains(&meta(2).id));
    }

    #[test]
    fn unwritable_disk_degrades_to_ram() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the folder should be: the folder cannot be created.
        let blocker = dir.path().join("blocked");
        std::fs::write(&blocker, b"x").unwrap();
        let s = PageStore::open(StoreConfig {
            ram_bytes: 1 << 20,
            disk_dir: Some(blocker.join("pages")),
            disk_bytes: 1 << 20,
            far: None,
            far_bytes: 0,
        });
        assert_eq!(s.stats().disk_degraded.load(Relaxed), 1);
        assert!(s.put(&meta(1), &[1; 10]));
        assert!(s.get(&meta(1).id, &meta(1).salt).is_some());
        // Budget 0: no disk tier at all, no error.
        let s = PageStore::open(StoreConfig {
            ram_bytes: 1 << 20,
            disk_dir: Some(dir.path().into()),
            disk_bytes: 0,
            far: None,
            far_bytes: 0,
        });
        assert!(s.put(&meta(1), &[1; 10]));
        assert_eq!(s.stats().disk_degraded.load(Relaxed), 0);
    }

    #[test]
    fn disk_budget_deletes_least_recently_used() {
        let dir = tempfile::tempdir().unwrap();
        let page_len = (page::HEADER_LEN + 100) as u64;
        let s = PageStore::open(StoreConfig {
            ram_bytes: 1 << 20,
            disk_dir: Some(dir.path().into()),
            disk_bytes: 2 * page_len,
            far: None,
            far_bytes: 0,
        });
        for i in 0..3 {
            s.put(&meta(i), &[i; 100]);
        }
        s.flush();
        assert_eq!(s.stats().pages_disk.load(Relaxed), 2);
        assert_eq!(s.stats().evicted_disk.load(Relaxed), 1);
        assert!(!dir
            .path()
            .join(format!("{}.page", meta(0).id.to_hex()))
            .exists());
    }
}
