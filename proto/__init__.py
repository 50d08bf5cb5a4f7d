"""Wire contract: isthmus.v1 protobuf messages and gRPC services (generated code committed)."""
