//! Compiles `proto/` (kvrouter's own gRPC API, package `kvrouter.v1`) into Rust with tonic.
//! The .proto files are parsed by `protox`, a protobuf compiler in Rust, so the build needs no
//! system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/kvrouter/v1/admin.proto",
        "proto/kvrouter/v1/explain.proto",
        "proto/kvrouter/v1/kv_events.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
