//! ts/generated/boundary.ts and ts/generated/folder-contract.ts are what the Rust side renders: a
//! field added on one side only fails here (the Rust side's types) or in the TypeScript build (the
//! facade's and the model tooling's uses of them).

use std::path::Path;

/// The committed file at `output` is `rendered`; with ORTEX_WRITE_TS set, it is written instead.
fn check_current(output: &str, rendered: &str, what: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = root.join(output);
    if std::env::var_os("ORTEX_WRITE_TS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, rendered).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == rendered,
        "{output} is stale: {what} changed. Run `ORTEX_WRITE_TS=1 cargo test -p ortex-typegen` and commit it."
    );
}

#[test]
fn generated_typescript_is_current() {
    check_current(ortex_typegen::OUTPUT, &ortex_typegen::render(), "the Rust side's inputs, views or constants");
}

#[test]
fn generated_folder_contract_is_current() {
    check_current(
        ortex_typegen::CONTRACT_OUTPUT,
        &ortex_typegen::render_contract(),
        "ortex-ort's folder contract (tensor names, genai_config.json fields, model types)",
    );
}
