"""Generated protobuf/gRPC code for the specpipe.v1 API (built from protos/)."""
