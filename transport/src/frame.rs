//! Length-prefixed, version-tagged rkyv frames.
//!
//! ```text
//! 0      2          4                8
//! ┌──────┬──────────┬────────────────┬──────────────────────┐
//! │ "MS" │ version  │ payload length │ rkyv archive (len B) │
//! │      │ u16 LE   │ u32 LE         │                      │
//! └──────┴──────────┴────────────────┴──────────────────────┘
//! ```
//! A receiver checks magic, version and length against its limit before reading the
//! payload, copies the payload into an aligned buffer (network bytes are unaligned),
//! and validates the archive (bytecheck) before deserializing. Any failure is a
//! [`FrameError`] with a stable [`FrameError::code`]; the caller closes that stream with
//! the code and keeps the connection and the node running.

use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};

use bytes::{BufMut, Bytes, BytesMut};
use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::rancor;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::util::AlignedVec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"MS";
/// Version of the envelope types this build speaks (2: `GenerateCall.reasoning_budget` and the
/// reasoning counts of `Event::Done`; 3: `GenerateCall.role`; 4: the draft counts of
/// `Event::Done`; 5: calls to named actors (`Request::Call` with an envelope, the tier,
/// page-store and router protocols) and roles, actors and store pages in adverts; 6: prompt
/// parts in `TierCall::Tokenize`, and the cached prompt tokens and matched stop string of
/// `Event::Done`; 7: engine counters and capacity in adverts, later with the node's GPUs;
/// 8: the device memory a loadable tier takes, `LoadableTier.gpu_bytes`; 9: the planner's
/// protocol and a node's standby tiers; 10: the build and capabilities in adverts).
///
/// A node speaks every version from [`OLDEST_WIRE_VERSION`] to this one: each connection
/// uses the highest both sides speak (chosen in the TLS handshake by ALPN, see [`alpn`]),
/// so a cluster can be upgraded one node at a time.
pub const WIRE_VERSION: u16 = 10;
/// The oldest version this build still speaks (one before [`WIRE_VERSION`]).
pub const OLDEST_WIRE_VERSION: u16 = 9;

/// The newest version this process speaks: [`WIRE_VERSION`] unless
/// [`limit_wire_version`] lowered it.
static NEWEST_SPOKEN: AtomicU16 = AtomicU16::new(WIRE_VERSION);

/// Makes this process speak only versions up to `v`, as a node of the older build would
/// (rolling-upgrade tests; `MESH_WIRE_VERSION`). Call before the node's endpoint is built.
pub fn limit_wire_version(v: u16) -> Result<(), FrameError> {
    if !(OLDEST_WIRE_VERSION..=WIRE_VERSION).contains(&v) {
        return Err(FrameError::Version { got: v });
    }
    NEWEST_SPOKEN.store(v, Ordering::Relaxed);
    Ok(())
}

/// The versions this process speaks, newest first.
pub fn spoken_versions() -> Vec<u16> {
    (OLDEST_WIRE_VERSION..=NEWEST_SPOKEN.load(Ordering::Relaxed))
        .rev()
        .collect()
}

/// The newest version this process speaks.
pub fn newest_spoken() -> u16 {
    NEWEST_SPOKEN.load(Ordering::Relaxed)
}

/// The ALPN protocol name of wire version `v`. Version 9 keeps the name every build up to
/// it offered (`mesh/1`), so those builds and this one still agree on it.
pub fn alpn(v: u16) -> Vec<u8> {
    if v <= 9 {
        b"mesh/1".to_vec()
    } else {
        format!("mesh/w{v}").into_bytes()
    }
}

/// The wire version an ALPN protocol name stands for, if this process speaks it.
pub fn alpn_version(name: &[u8]) -> Option<u16> {
    spoken_versions().into_iter().find(|v| alpn(*v) == name)
}
/// Bytes before the payload.
pub const HEADER_LEN: usize = 8;
/// Default payload limit of control frames (1 MiB).
pub const DEFAULT_MAX_FRAME: usize = 1 << 20;

/// Why a frame was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame")]
    Truncated,
    /// The first bytes are not a mesh frame.
    #[error("bad frame magic")]
    BadMagic,
    /// The peer speaks another wire version.
    #[error(
        "wire version {got} not supported (this node speaks {OLDEST_WIRE_VERSION} to {})",
        newest_spoken()
    )]
    Version {
        /// The version in the frame.
        got: u16,
    },
    /// The frame is longer than this stream allows.
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Announced payload length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// The payload is not a valid archive of the expected type.
    #[error("invalid frame payload: {0}")]
    Invalid(String),
    /// The stream failed underneath.
    #[error("stream error: {0}")]
    Io(String),
}

impl FrameError {
    /// Application error code the stream is closed with.
    pub fn code(&self) -> u32 {
        match self {
            Self::Truncated => 0x10,
            Self::BadMagic => 0x11,
            Self::Version { .. } => 0x12,
            Self::TooLarge { .. } => 0x13,
            Self::Invalid(_) => 0x14,
            Self::Io(_) => 0x15,
        }
    }
}

/// Process-wide frame counters (exported as metrics by the node).
#[derive(Debug, Default)]
pub struct FrameStats {
    /// Frames decoded.
    pub frames_in: AtomicU64,
    /// Frames encoded.
    pub frames_out: AtomicU64,
    /// Payload bytes received.
    pub bytes_in: AtomicU64,
    /// Payload bytes sent.
    pub bytes_out: AtomicU64,
    /// Frames refused (malformed, truncated, oversized, wrong version).
    pub refused: AtomicU64,
}

/// The counters of this process.
pub static STATS: FrameStats = FrameStats {
    frames_in: AtomicU64::new(0),
    frames_out: AtomicU64::new(0),
    bytes_in: AtomicU64::new(0),
    bytes_out: AtomicU64::new(0),
    refused: AtomicU64::new(0),
};

/// Types that can be written as a frame.
pub trait Encode:
    for<'a> rkyv::Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>
{
}
impl<T> Encode for T where
    T: for<'a> rkyv::Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>
{
}

/// Types that can be read from a frame.
pub trait Decode: rkyv::Archive + Sized
where
    Self::Archived: for<'a> rkyv::bytecheck::CheckBytes<HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<Self, HighDeserializer<rancor::Error>>,
{
}
impl<T> Decode for T
where
    T: rkyv::Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<T, HighDeserializer<rancor::Error>>,
{
}

/// Encodes `v` as one frame (header + archive) of the newest version this process speaks.
pub fn encode<T: Encode>(v: &T) -> Result<Bytes, FrameError> {
    encode_as(v, newest_spoken())
}

/// Encodes `v` as one frame whose header says wire version `version` (the connection's).
pub fn encode_as<T: Encode>(v: &T, version: u16) -> Result<Bytes, FrameError> {
    let body =
        rkyv::to_bytes::<rancor::Error>(v).map_err(|e| FrameError::Invalid(e.to_string()))?;
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge {
        len: body.len(),
        max: u32::MAX as usize,
    })?;
    let mut out = BytesMut::with_capacity(HEADER_LEN + body.len());
    out.put_slice(&MAGIC);
    out.put_u16_le(version);
    out.put_u32_le(len);
    out.put_slice(&body);
    STATS.frames_out.fetch_add(1, Ordering::Relaxed);
    STATS
        .bytes_out
        .fetch_add(body.len() as u64, Ordering::Relaxed);
    Ok(out.freeze())
}

/// Checks a header; returns the payload length.
pub fn parse_header(h: &[u8; HEADER_LEN], max: usize) -> Result<usize, FrameError> {
    parse_header_versioned(h, max).map(|(_, len)| len)
}

/// Checks a header (a version this process speaks); returns the version and the payload
/// length.
pub fn parse_header_versioned(
    h: &[u8; HEADER_LEN],
    max: usize,
) -> Result<(u16, usize), FrameError> {
    if h[0..2] != MAGIC {
        return Err(FrameError::BadMagic);
    }
    let version = u16::from_le_bytes([h[2], h[3]]);
    if !(OLDEST_WIRE_VERSION..=newest_spoken()).contains(&version) {
        return Err(FrameError::Version { got: version });
    }
    let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok((version, len))
}

/// Validates and deserializes one payload.
pub fn decode<T>(payload: &[u8]) -> Result<T, FrameError>
where
    T: Decode,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<T, HighDeserializer<rancor::Error>>,
{
    let mut aligned = AlignedVec::<16>::with_capacity(payload.len());
    aligned.extend_from_slice(payload);
    let v = rkyv::from_bytes::<T, rancor::Error>(&aligned)
        .map_err(|e| FrameError::Invalid(e.to_string()))?;
    STATS.frames_in.fetch_add(1, Ordering::Relaxed);
    STATS
        .bytes_in
        .fetch_add(payload.len() as u64, Ordering::Relaxed);
    Ok(v)
}

/// Reads one frame; `Ok(None)` when the stream ended cleanly between frames.
///
/// Cancel safety: not cancel-safe (a partly read frame is lost with the stream).
pub async fn read_frame<T, R>(r: &mut R, max: usize) -> Result<Option<T>, FrameError>
where
    R: AsyncRead + Unpin,
    T: Decode,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<T, HighDeserializer<rancor::Error>>,
{
    let res = read_frame_inner(r, max).await;
    if res.is_err() {
        STATS.refused.fetch_add(1, Ordering::Relaxed);
    }
    res
}

async fn read_frame_inner<T, R>(r: &mut R, max: usize) -> Result<Option<T>, FrameError>
where
    R: AsyncRead + Unpin,
    T: Decode,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<T, HighDeserializer<rancor::Error>>,
{
    match read_payload_inner(r, max).await? {
        Some((_, payload)) => decode(&payload).map(Some),
        None => Ok(None),
    }
}

/// Reads one frame's version and payload, not decoded (for types whose layout depends on
/// the version); `Ok(None)` when the stream ended cleanly between frames.
///
/// Cancel safety: not cancel-safe.
pub async fn read_payload<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> Result<Option<(u16, Vec<u8>)>, FrameError> {
    let res = read_payload_inner(r, max).await;
    if res.is_err() {
        STATS.refused.fetch_add(1, Ordering::Relaxed);
    }
    res
}

async fn read_payload_inner<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> Result<Option<(u16, Vec<u8>)>, FrameError> {
    let mut h = [0u8; HEADER_LEN];
    let mut filled = 0;
    while filled < HEADER_LEN {
        let n = r
            .read(&mut h[filled..])
            .await
            .map_err(|e| FrameError::Io(e.to_string()))?;
        if n == 0 {
            return if filled == 0 {
                Ok(None)
            } else {
                Err(FrameError::Truncated)
            };
        }
        filled += n;
        // Refuse garbage as soon as the magic is wrong, without waiting for more.
        if filled >= 2 && h[0..2] != MAGIC {
            return Err(FrameError::BadMagic);
        }
    }
    let (version, len) = parse_header_versioned(&h, max)?;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
            _ => FrameError::Io(e.to_string()),
        })?;
    Ok(Some((version, payload)))
}

/// Writes one frame of the newest version this process speaks.
///
/// Cancel safety: not cancel-safe (a partly written frame corrupts the stream).
pub async fn write_frame<T: Encode, W: AsyncWrite + Unpin>(
    w: &mut W,
    v: &T,
) -> Result<(), FrameError> {
    write_frame_as(w, v, newest_spoken()).await
}

/// Writes one frame whose header says wire version `version` (the connection's).
///
/// Cancel safety: not cancel-safe (a partly written frame corrupts the stream).
pub async fn write_frame_as<T: Encode, W: AsyncWrite + Unpin>(
    w: &mut W,
    v: &T,
    version: u16,
) -> Result<(), FrameError> {
    let bytes = encode_as(v, version)?;
    w.write_all(&bytes)
        .await
        .map_err(|e| FrameError::Io(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, PartialEq, Clone)]
    enum Msg {
        Ping(u64),
        Text { a: String, b: Vec<u32> },
    }

    async fn read_all(bytes: &[u8], max: usize) -> Vec<Result<Option<Msg>, FrameError>> {
        let mut r = bytes;
        let mut out = vec![];
        loop {
            let x = read_frame::<Msg, _>(&mut r, max).await;
            let stop = !matches!(x, Ok(Some(_)));
            out.push(x);
            if stop {
                return out;
            }
        }
    }

    #[tokio::test]
    async fn roundtrip_several_frames() {
        let a = Msg::Ping(7);
        let b = Msg::Text {
            a: "héllo".into(),
            b: vec![1, 2, 3],
        };
        let mut buf = encode(&a).unwrap().to_vec();
        buf.extend_from_slice(&encode(&b).unwrap());
        let got = read_all(&buf, 1024).await;
        assert_eq!(got, vec![Ok(Some(a)), Ok(Some(b)), Ok(None)]);
    }

    #[tokio::test]
    async fn a_frame_of_the_older_version_is_read_with_its_version() {
        let mut buf = encode_as(&Msg::Ping(3), OLDEST_WIRE_VERSION)
            .unwrap()
            .to_vec();
        buf.extend_from_slice(&encode(&Msg::Ping(4)).unwrap());
        let mut r = &buf[..];
        let (v, p) = read_payload(&mut r, 64).await.unwrap().unwrap();
        assert_eq!(
            (v, decode::<Msg>(&p).unwrap()),
            (OLDEST_WIRE_VERSION, Msg::Ping(3))
        );
        let (v, p) = read_payload(&mut r, 64).await.unwrap().unwrap();
        assert_eq!(
            (v, decode::<Msg>(&p).unwrap()),
            (WIRE_VERSION, Msg::Ping(4))
        );
    }

    #[test]
    fn alpn_names_stand_for_their_versions_and_version_9_keeps_the_old_name() {
        assert_eq!(alpn(9), b"mesh/1");
        for v in OLDEST_WIRE_VERSION..=WIRE_VERSION {
            assert_eq!(alpn_version(&alpn(v)), Some(v));
        }
        assert_eq!(alpn_version(&alpn(WIRE_VERSION + 1)), None);
        assert_eq!(alpn_version(b"h3"), None);
    }

    #[tokio::test]
    async fn refuses_bad_frames() {
        let good = encode(&Msg::Text {
            a: "x".repeat(100),
            b: vec![9; 10],
        })
        .unwrap();
        // Truncated anywhere after the first byte.
        for cut in [1, 5, HEADER_LEN, good.len() - 1] {
            let got = read_all(&good[..cut], 4096).await;
            assert_eq!(
                got.last().unwrap(),
                &Err(FrameError::Truncated),
                "cut {cut}"
            );
        }
        // Oversized.
        let got = read_all(&good, 16).await;
        assert!(matches!(got[0], Err(FrameError::TooLarge { .. })));
        // Wrong version.
        let mut v = good.to_vec();
        v[2] = 99;
        assert_eq!(
            read_all(&v, 4096).await[0],
            Err(FrameError::Version { got: 99 })
        );
        // Garbage.
        assert_eq!(
            read_all(b"GARBAGE!", 4096).await[0],
            Err(FrameError::BadMagic)
        );
        // Valid header, payload bytes scrambled: validation refuses instead of panicking.
        let mut seed = 0x1234_5678_u64;
        let mut refused = 0;
        for _ in 0..200 {
            let mut v = good.to_vec();
            for b in v[HEADER_LEN..].iter_mut() {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                *b = seed as u8;
            }
            if read_all(&v, 4096).await[0].is_err() {
                refused += 1;
            }
        }
        assert!(
            refused >= 190,
            "only {refused}/200 scrambled payloads refused"
        );
    }
}
