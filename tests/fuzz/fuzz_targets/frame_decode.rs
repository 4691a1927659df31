//! Wire frames: `parse_header`, `decode` and `read_frame` of `mesh_transport::frame` on
//! arbitrary bytes, and on damaged encodings of structured messages.
//!
//! The wire enums live in `mesh-actors`, which builds llama.cpp; this message type has
//! their shape (nested enums and structs, strings, vectors, options, floats, a generic).
//! Values are compared by their encoding, so a NaN survives the comparison.

#![no_main]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use libfuzzer_sys::arbitrary::{self, Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use mesh_transport::frame::{
    decode, encode, parse_header, read_frame, FrameError, DEFAULT_MAX_FRAME, HEADER_LEN,
};
use mesh_transport::WIRE_VERSION;

#[derive(Arbitrary, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
struct Tier {
    name: String,
    max_seq_len: u32,
    page_base: Vec<u8>,
    pages: Vec<u64>,
}

#[derive(Arbitrary, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
struct Call {
    model: String,
    prompt: Vec<i32>,
    temperature: f32,
    stop: Vec<String>,
    grammar: Option<String>,
    ignore_eos: bool,
    deadline_ms: u64,
}

#[derive(Arbitrary, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
enum Answer<T> {
    Item(T),
    End,
    Error { class: u8, message: String },
}

#[derive(Arbitrary, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
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

/// A payload the decoder accepted must be a value that survives another round trip.
fn check_accepted(m: &Msg) {
    let f = encode(m).expect("encode");
    let again: Msg = decode(&f[HEADER_LEN..]).expect("re-encoded value decodes");
    assert_eq!(
        encode(&again).expect("encode"),
        f,
        "round trip changed {m:?}"
    );
}

fn check_payload(payload: &[u8]) {
    match decode::<Msg>(payload) {
        Ok(m) => check_accepted(&m),
        Err(e) => assert!(matches!(e, FrameError::Invalid(_)), "{e:?}"),
    }
}

/// Polls a future that never waits (reads from a byte slice) to completion.
fn run<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        // The bytes as a payload.
        0 => check_payload(rest),
        // The bytes as a stream of frames: each frame read is a valid value, and reading
        // stops at a clean end or the first refused frame.
        1 => {
            let mut r = rest;
            for _ in 0..64 {
                match run(read_frame::<Msg, _>(&mut r, DEFAULT_MAX_FRAME)) {
                    Ok(Some(m)) => check_accepted(&m),
                    Ok(None) => {
                        assert!(r.is_empty());
                        break;
                    }
                    // A slice never fails underneath: every refusal is the frame's.
                    Err(e) => {
                        assert!(!matches!(e, FrameError::Io(_)), "{e:?}");
                        break;
                    }
                }
            }
        }
        // A structured message, encoded, then damaged and cut as the input says.
        _ => {
            let mut u = Unstructured::new(rest);
            let Ok(m) = Msg::arbitrary(&mut u) else {
                return;
            };
            let frame = encode(&m).expect("encode");
            let h: [u8; HEADER_LEN] = frame[..HEADER_LEN].try_into().expect("header");
            assert_eq!(parse_header(&h, usize::MAX), Ok(frame.len() - HEADER_LEN));
            assert_eq!(h[2..4], WIRE_VERSION.to_le_bytes());
            let mut payload = frame[HEADER_LEN..].to_vec();
            let flips: Vec<(u16, u8)> = Arbitrary::arbitrary(&mut u).unwrap_or_default();
            for (at, mask) in flips {
                if !payload.is_empty() {
                    let i = at as usize % payload.len();
                    payload[i] ^= mask;
                }
            }
            if let Ok(cut) = u16::arbitrary(&mut u) {
                payload.truncate(cut as usize);
            }
            check_payload(&payload);
        }
    }
});
