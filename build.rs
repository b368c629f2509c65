//! Link settings for the binaries.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    // Relative relocations packed (DT_RELR, glibc 2.36 and binutils 2.38 or later): the
    // loader reads a few KiB at start instead of the 430 KiB `.rela.dyn` table of a PIE
    // this size, and what it reads stays resident for the daemon's life.
    if var("CARGO_CFG_TARGET_OS") == "linux" && var("CARGO_CFG_TARGET_ENV") == "gnu" {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}
