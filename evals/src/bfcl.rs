//! Reading the Berkeley Function-Calling Leaderboard data (`scripts/fetch-bfcl.sh`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// `BFCL_v4_CATEGORY.json` (or v3) in `dir`.
pub fn find_file(dir: &Path, category: &str) -> Result<PathBuf> {
    for version in ["v4", "v3"] {
        let p = dir.join(format!("BFCL_{version}_{category}.json"));
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "no BFCL_v3/v4_{category}.json in {} (run scripts/fetch-bfcl.sh)",
        dir.display()
    )
}

/// The records of a JSON-lines file.
pub fn read_jsonl(path: &Path) -> Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("a line of {}", path.display())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_category_says_how_to_fetch_the_data() {
        let dir = std::env::temp_dir();
        let e = find_file(&dir, "no_such_category").unwrap_err();
        assert!(e.to_string().contains("run scripts/fetch-bfcl.sh"), "{e}");
    }

    #[test]
    fn a_bad_line_names_its_file() {
        let path = std::env::temp_dir().join(format!("bfcl-bad-{}.json", std::process::id()));
        std::fs::write(&path, "{\"id\": 1}\nnot json\n").unwrap();
        let e = read_jsonl(&path).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(format!("{e:#}").contains("a line of"), "{e:#}");
    }
}
