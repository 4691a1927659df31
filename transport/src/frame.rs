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

use std::sync::atomic::{AtomicU64, Ordering};

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
/// 8: the device memory a loadable tier takes, `LoadableTier.gpu_bytes`).
pub const WIRE_VERSION: u16 = 9;
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
    #[error("wire version {got} not supported (this node speaks {WIRE_VERSION})")]
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

/// Encodes `v` as one frame (header + archive).
pub fn encode<T: Encode>(v: &T) -> Result<Bytes, FrameError> {
    let body =
        rkyv::to_bytes::<rancor::Error>(v).map_err(|e| FrameError::Invalid(e.to_string()))?;
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge {
        len: body.len(),
        max: u32::MAX as usize,
    })?;
    let mut out = BytesMut::with_capacity(HEADER_LEN + body.len());
    out.put_slice(&MAGIC);
    out.put_u16_le(WIRE_VERSION);
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
    if h[0..2] != MAGIC {
        return Err(FrameError::BadMagic);
    }
    let version = u16::from_le_bytes([h[2], h[3]]);
    if version != WIRE_VERSION {
        return Err(FrameError::Version { got: version });
    }
    let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok(len)
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
    let len = parse_header(&h, max)?;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
            _ => FrameError::Io(e.to_string()),
        })?;
    decode(&payload).map(Some)
}

/// Writes one frame.
///
/// Cancel safety: not cancel-safe (a partly written frame corrupts the stream).
pub async fn write_frame<T: Encode, W: AsyncWrite + Unpin>(
    w: &mut W,
    v: &T,
) -> Result<(), FrameError> {
    let bytes = encode(v)?;
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
