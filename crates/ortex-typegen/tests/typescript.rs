//! ts/generated/boundary.ts is what the Rust side renders: a field added on one side only fails
//! here (the Rust side's types) or in the TypeScript build (the facade's uses of them).

use std::path::Path;

#[test]
fn generated_typescript_is_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = root.join(ortex_typegen::OUTPUT);
    let rendered = ortex_typegen::render();
    if std::env::var_os("ORTEX_WRITE_TS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &rendered).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == rendered,
        "{} is stale: the Rust side's inputs, views or constants changed. Run `ORTEX_WRITE_TS=1 cargo test -p ortex-typegen` and commit it.",
        ortex_typegen::OUTPUT
    );
}
