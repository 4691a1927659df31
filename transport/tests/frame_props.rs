//! Property tests of the frame codec (`mesh_transport::frame`).
//!
//! The transport does not know the wire enums (they live in `mesh-actors`, which builds
//! llama.cpp), so these use a message type of the same shape: nested enums and structs,
//! strings, byte and integer vectors, options, floats and a generic answer.

use std::pin::Pin;
use std::task::{Context, Poll};

use mesh_transport::frame::OLDEST_WIRE_VERSION;
use mesh_transport::frame::{
    self, decode, encode, parse_header, read_frame, FrameError, HEADER_LEN, MAGIC,
};
use mesh_transport::WIRE_VERSION;
use proptest::prelude::*;
use tokio::io::{AsyncRead, ReadBuf};

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, PartialEq)]
struct Tier {
    name: String,
    max_seq_len: u32,
    page_base: Vec<u8>,
    pages: Vec<u64>,
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, PartialEq)]
struct Call {
    model: String,
    prompt: Vec<i32>,
    temperature: f32,
    stop: Vec<String>,
    grammar: Option<String>,
    ignore_eos: bool,
    deadline_ms: u64,
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, PartialEq)]
enum Answer<T> {
    Item(T),
    End,
    Error { class: u8, message: String },
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, PartialEq)]
enum Msg {
    Ping {
        nonce: u64,
        payload: Vec<u8>,
    },
    Advert {
        node: String,
        started_ms: u64,
        tiers: Vec<Tier>,
    },
    Generate(Call),
    Tokens(Answer<Vec<i32>>),
    Leave,
}

fn tier() -> impl Strategy<Value = Tier> {
    (
        ".{0,12}",
        any::<u32>(),
        prop::collection::vec(any::<u8>(), 0..40),
        prop::collection::vec(any::<u64>(), 0..8),
    )
        .prop_map(|(name, max_seq_len, page_base, pages)| Tier {
            name,
            max_seq_len,
            page_base,
            pages,
        })
}

fn call() -> impl Strategy<Value = Call> {
    (
        ".{0,12}",
        prop::collection::vec(any::<i32>(), 0..32),
        // NaN is never equal to itself; every other f32 must survive the trip.
        any::<f32>().prop_filter("not NaN", |t| !t.is_nan()),
        prop::collection::vec(".{0,6}", 0..4),
        prop::option::of(".{0,24}"),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(model, prompt, temperature, stop, grammar, ignore_eos, deadline_ms)| Call {
                model,
                prompt,
                temperature,
                stop,
                grammar,
                ignore_eos,
                deadline_ms,
            },
        )
}

fn msg() -> impl Strategy<Value = Msg> {
    prop_oneof![
        (any::<u64>(), prop::collection::vec(any::<u8>(), 0..200))
            .prop_map(|(nonce, payload)| Msg::Ping { nonce, payload }),
        (".{0,16}", any::<u64>(), prop::collection::vec(tier(), 0..4)).prop_map(
            |(node, started_ms, tiers)| Msg::Advert {
                node,
                started_ms,
                tiers
            }
        ),
        call().prop_map(Msg::Generate),
        prop_oneof![
            prop::collection::vec(any::<i32>(), 0..16).prop_map(Answer::Item),
            Just(Answer::End),
            (any::<u8>(), ".{0,20}").prop_map(|(class, message)| Answer::Error { class, message }),
        ]
        .prop_map(Msg::Tokens),
        Just(Msg::Leave),
    ]
}

/// An `AsyncRead` over a byte slice that hands out at most the next of `sizes` bytes per
/// read (cycling), as a QUIC stream hands out whatever has arrived.
struct Trickle<'a> {
    data: &'a [u8],
    sizes: Vec<usize>,
    turn: usize,
}

impl AsyncRead for Trickle<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let want = self.sizes[self.turn % self.sizes.len()];
        self.turn += 1;
        let n = want.min(buf.remaining()).min(self.data.len());
        buf.put_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Poll::Ready(Ok(()))
    }
}

/// Reads frames until the stream ends or a frame is refused.
fn read_all(bytes: &[u8], sizes: Vec<usize>, max: usize) -> Vec<Result<Option<Msg>, FrameError>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut r = Trickle {
            data: bytes,
            sizes,
            turn: 0,
        };
        let mut out = vec![];
        loop {
            let x = read_frame::<Msg, _>(&mut r, max).await;
            let stop = !matches!(x, Ok(Some(_)));
            out.push(x);
            if stop {
                return out;
            }
        }
    })
}

/// The frame of `m` after one more decode and encode. Compared as bytes, because a
/// damaged float may be NaN, which no value equals, though it survives bit for bit.
fn round_trip(m: &Msg) -> Vec<u8> {
    let f = encode(m).unwrap();
    let again: Msg = decode(&f[HEADER_LEN..]).unwrap();
    encode(&again).unwrap().to_vec()
}

fn header_of(frame: &[u8]) -> [u8; HEADER_LEN] {
    frame[..HEADER_LEN].try_into().expect("header")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// An encoded message comes back equal, and its header announces exactly its payload.
    #[test]
    fn encoded_message_decodes_to_itself(m in msg()) {
        let f = encode(&m).unwrap();
        let len = parse_header(&header_of(&f), usize::MAX).unwrap();
        prop_assert_eq!(len, f.len() - HEADER_LEN);
        prop_assert_eq!(decode::<Msg>(&f[HEADER_LEN..]).unwrap(), m);
    }

    /// A header is accepted exactly when the magic matches, the version is one this build
    /// speaks and the length is within
    /// the limit, and then its length field is what is returned.
    #[test]
    fn header_accepted_iff_well_formed(
        h in prop_oneof![
            any::<[u8; HEADER_LEN]>(),
            // Mostly valid headers, so the length and limit checks are reached.
            (any::<u32>(), 0..4u8).prop_map(|(len, pick)| {
                let mut h = [0u8; HEADER_LEN];
                h[..2].copy_from_slice(&MAGIC);
                // Both spoken versions, and the one on either side of them.
                let v = match pick {
                    0 => WIRE_VERSION,
                    1 => OLDEST_WIRE_VERSION,
                    2 => WIRE_VERSION + 1,
                    _ => OLDEST_WIRE_VERSION - 1,
                };
                h[2..4].copy_from_slice(&v.to_le_bytes());
                h[4..].copy_from_slice(&len.to_le_bytes());
                h
            }),
        ],
        max in prop_oneof![Just(frame::DEFAULT_MAX_FRAME), any::<u32>().prop_map(|m| m as usize)],
    ) {
        let version = u16::from_le_bytes([h[2], h[3]]);
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let want = if h[..2] != MAGIC {
            Err(FrameError::BadMagic)
        } else if !(OLDEST_WIRE_VERSION..=WIRE_VERSION).contains(&version) {
            Err(FrameError::Version { got: version })
        } else if len > max {
            Err(FrameError::TooLarge { len, max })
        } else {
            Ok(len)
        };
        prop_assert_eq!(parse_header(&h, max), want);
    }

    /// Arbitrary payload bytes never panic the decoder: they are refused as invalid, or
    /// they are a valid archive whose value survives another round trip.
    #[test]
    fn arbitrary_payload_is_refused_or_valid(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        match decode::<Msg>(&bytes) {
            Err(e) => prop_assert!(matches!(e, FrameError::Invalid(_)), "{e:?}"),
            Ok(m) => prop_assert_eq!(round_trip(&m), encode(&m).unwrap()),
        }
    }

    /// A damaged payload byte never panics the decoder, and whatever it accepts is a
    /// valid value (rkyv has no checksum: a flipped integer byte is another integer).
    #[test]
    fn damaged_payload_is_refused_or_valid(m in msg(), at in any::<prop::sample::Index>(), mask in 1u8..) {
        let f = encode(&m).unwrap();
        let mut payload = f[HEADER_LEN..].to_vec();
        let i = at.index(payload.len());
        payload[i] ^= mask;
        if let Ok(got) = decode::<Msg>(&payload) {
            prop_assert_eq!(round_trip(&got), encode(&got).unwrap());
        }
    }

    /// A stream of frames is read back frame by frame whatever sizes the reads return
    /// (a header may arrive one byte at a time), then ends cleanly.
    #[test]
    fn frames_read_back_at_any_read_size(
        msgs in prop::collection::vec(msg(), 0..5),
        sizes in prop::collection::vec(1usize..24, 1..6),
    ) {
        let mut stream = vec![];
        for m in &msgs {
            stream.extend_from_slice(&encode(m).unwrap());
        }
        let mut want: Vec<_> = msgs.into_iter().map(|m| Ok(Some(m))).collect();
        want.push(Ok(None));
        prop_assert_eq!(read_all(&stream, sizes, 1 << 16), want);
    }

    /// A stream cut anywhere inside its last frame yields the frames before it, then
    /// `Truncated`, never a value.
    #[test]
    fn truncated_stream_is_refused(
        msgs in prop::collection::vec(msg(), 1..4),
        cut in any::<prop::sample::Index>(),
        sizes in prop::collection::vec(1usize..64, 1..4),
    ) {
        let frames: Vec<_> = msgs.iter().map(|m| encode(m).unwrap()).collect();
        let last = frames.last().unwrap();
        let keep = 1 + cut.index(last.len() - 1);
        let mut stream: Vec<u8> = frames[..frames.len() - 1].iter().flatten().copied().collect();
        stream.extend_from_slice(&last[..keep]);
        let mut want: Vec<_> = msgs[..msgs.len() - 1].iter().cloned().map(|m| Ok(Some(m))).collect();
        want.push(Err(FrameError::Truncated));
        prop_assert_eq!(read_all(&stream, sizes, 1 << 16), want);
    }
}
