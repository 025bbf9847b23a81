"""The generated protobuf and gRPC modules of the kvrouter.v1 contract, under short names.

Use ``pb.worker.KvEvent``, ``pb.router.RouteRequest`` and so on; the modules are regenerated from
proto/ by clients/python/generate.sh.
"""

from kvrouter_client._gen.kvrouter.v1 import admin_pb2 as admin
from kvrouter_client._gen.kvrouter.v1 import admin_pb2_grpc as admin_grpc
from kvrouter_client._gen.kvrouter.v1 import router_pb2 as router
from kvrouter_client._gen.kvrouter.v1 import router_pb2_grpc as router_grpc
from kvrouter_client._gen.kvrouter.v1 import types_pb2 as types
from kvrouter_client._gen.kvrouter.v1 import worker_pb2 as worker
from kvrouter_client._gen.kvrouter.v1 import worker_pb2_grpc as worker_grpc

__all__ = ["admin", "admin_grpc", "router", "router_grpc", "types", "worker", "worker_grpc"]
