"""The Open Inference Protocol over gRPC (``--grpc_port``), beside HTTP in the same process.

The health, metadata and ModelInfer RPCs of ``tritonclient[grpc]``'s ``GRPCInferenceService`` (the others answer
UNIMPLEMENTED), through the same ``ServingModel`` as the HTTP routes, counted in
``mepo_predict_requests_total{protocol="grpc"}`` with the HTTP status each answer corresponds to. Images come as
``server.oip`` says, in ``raw_input_contents`` or ``contents.bytes_contents``; outputs go back in
``raw_output_contents``; errors carry the status codes ``CODES`` maps HTTP's to.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg

from mepo_stream import __version__
from server import oip
from server.config import ServeConfig
from server.serving import ServingModel
from server.web.dependencies import ApiError, served_model
from server.web.prediction import predict_uploads

log = logging.getLogger(__name__)
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
         422: grpc.StatusCode.INVALID_ARGUMENT, 503: grpc.StatusCode.UNAVAILABLE}


class InferenceService(pbg.GRPCInferenceServiceServicer):
    """The RPCs, over one running ``ServingModel``."""

    def __init__(self, service: ServingModel, settings: ServeConfig):
        self.service, self.settings = service, settings

    def ServerLive(self, request, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.readiness().ready)

    def ServerMetadata(self, request, context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="mepo-stream", version=__version__, extensions=[])

    def ModelReady(self, request, context) -> pb.ModelReadyResponse:
        self._model(request.name, context)
        return pb.ModelReadyResponse(ready=bool(self.service.snapshot.exposed))

    def ModelMetadata(self, request, context) -> pb.ModelMetadataResponse:
        self._model(request.name, context)
        meta = oip.model_metadata(request.name)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        inputs=[tensor(**t) for t in meta["inputs"]],
                                        outputs=[tensor(**t) for t in meta["outputs"]])

    def ModelInfer(self, request, context) -> pb.ModelInferResponse:
        """One inference, counted whatever its outcome."""
        try:
            answer = self._infer(request)
        except ApiError as e:
            self._count(e.status_code)
            context.abort(CODES.get(e.status_code, grpc.StatusCode.INVALID_ARGUMENT), str(e.detail))
        self._count(200)
        return answer

    def _infer(self, request) -> pb.ModelInferResponse:
        served_model(request.model_name, self.settings)
        items = self.images_of(request)
        top_k = self._top_k(request)
        meta, rows = predict_uploads(self.service, [(f"{oip.INPUT_NAME}[{i}]", d) for i, d in enumerate(items)],
                                     self.settings, top_k)
        arrays = oip.output_arrays(rows)  # name -> [N, k]
        names = [o.name for o in request.outputs] or list(oip.OUTPUTS)
        if unknown := [n for n in names if n not in oip.OUTPUTS]:
            raise ApiError(400, f"unknown outputs {unknown}; the model has {list(oip.OUTPUTS)}", "invalid_request")
        out = pb.ModelInferResponse.InferOutputTensor
        return pb.ModelInferResponse(
            model_name=request.model_name, model_version=str(meta["model_version"]), id=request.id,
            parameters={"samples_seen": pb.InferParameter(int64_param=meta["samples_seen"])},
            outputs=[out(name=n, datatype=oip.OUTPUTS[n], shape=list(arrays[n].shape)) for n in names],
            raw_output_contents=[arrays[n].tobytes() for n in names])

    @staticmethod
    def images_of(request) -> list[bytes]:
        """The encoded images of the one BYTES input, raw or in ``contents``."""
        if len(request.inputs) != 1:
            raise ApiError(400, f"{len(request.inputs)} inputs; the model takes one, {oip.INPUT_NAME!r}",
                           "invalid_request")
        tensor = request.inputs[0]
        if tensor.datatype != "BYTES" or len(tensor.shape) != 1:
            raise ApiError(400, f"input {tensor.name!r} is {tensor.datatype} of shape {list(tensor.shape)}; the "
                                f"model takes BYTES of shape [N]", "invalid_request")
        try:
            items = (oip.deserialize_bytes(request.raw_input_contents[0], tensor.shape[0])
                     if request.raw_input_contents else list(tensor.contents.bytes_contents))
        except oip.TensorError as e:
            raise ApiError(400, f"input {tensor.name!r}: {e}", "invalid_request") from e
        if tensor.shape[0] != len(items):
            raise ApiError(400, f"shape {list(tensor.shape)} does not match {len(items)} data items", "invalid_request")
        return items

    def _top_k(self, request) -> int:
        if "top_k" not in request.parameters:
            return self.settings.top_k
        top_k = request.parameters["top_k"].int64_param
        if not 1 <= top_k <= oip.MAX_TOP_K:
            raise ApiError(400, f"top_k {top_k} is not between 1 and {oip.MAX_TOP_K} (an int64 parameter)",
                           "invalid_request")
        return top_k

    def _model(self, name: str, context) -> None:
        try:
            served_model(name, self.settings)
        except ApiError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, e.detail)

    def _count(self, status: int) -> None:
        self.service.metrics.predict_requests.labels("grpc", str(status)).inc()


def serve_grpc(service: ServingModel, settings: ServeConfig, workers: int = 8) -> grpc.Server:
    """Start the gRPC server; gRPC itself refuses a message over the raw request limit, before holding it whole."""
    limit = oip.raw_request_limit(settings)
    server = grpc.server(futures.ThreadPoolExecutor(workers, thread_name_prefix="mepo-grpc"),
                         options=[("grpc.max_receive_message_length", limit),
                                  ("grpc.max_send_message_length", limit)])
    pbg.add_GRPCInferenceServiceServicer_to_server(InferenceService(service, settings), server)
    if server.add_insecure_port(f"{settings.host}:{settings.grpc_port}") == 0:
        raise OSError(f"cannot listen for gRPC on {settings.host}:{settings.grpc_port}")
    server.start()
    log.info("Open Inference Protocol over gRPC on %s:%d", settings.host, settings.grpc_port)
    return server
