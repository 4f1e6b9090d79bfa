#!/usr/bin/env python3
"""A minimal OTLP trace receiver built on the official protobuf definitions and gRPC service
(`opentelemetry-proto`, `grpcio`): it decodes every export, OTLP/HTTP (POST /v1/traces) or
OTLP/gRPC (TraceService/Export), and appends each span, as one JSON line with the protocol it
came by, to OUT (actors/tests/integration/traces.rs runs it). It prints the HTTP port and the gRPC port,
on one line, first.

    otlp-receiver.py OUT
"""
import json
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

out = open(sys.argv[1], "a", buffering=1)
lock = threading.Lock()


def record(request, protocol):
    with lock:
        for rs in request.resource_spans:
            service = next(
                (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), ""
            )
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.write(json.dumps({
                        "protocol": protocol,
                        "service": service,
                        "name": s.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "events": len(s.events),
                    }) + "\n")


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        record(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_response(400)
            self.end_headers()
            return
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        record(request, "http")
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
trace_service_pb2_grpc.add_TraceServiceServicer_to_server(GrpcReceiver(), grpc_server)
grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
grpc_server.start()
server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
print(server.server_address[1], grpc_port, flush=True)
server.serve_forever()
