"""deploy/: the Ray Serve config and the KubeRay RayService manifest are valid and mean what
`octavo serve --ray` means. Ray Serve's own config schema checks the Serve configs; the
RayService is checked against the fields KubeRay's ray.io/v1 CRD requires (the CRD's full
OpenAPI schema is not installable here: it ships with the KubeRay operator, not on PyPI)."""

from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from octavo.server.ray_serve.launch import app_builder, parse_flags

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

# KubeRay ray.io/v1 RayService: the required fields and their types (ray-operator's
# RayServiceSpec / RayClusterSpec / HeadGroupSpec / WorkerGroupSpec).
_CONTAINERS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["name", "image"],
        "properties": {"name": {"type": "string"}, "image": {"type": "string"}},
    },
}
_POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {"containers": _CONTAINERS},
        }
    },
}
_START_PARAMS = {"type": "object", "additionalProperties": {"type": "string"}}
RAYSERVICE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayService"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["serveConfigV2", "rayClusterConfig"],
            "properties": {
                "serveConfigV2": {"type": "string"},
                "serviceUnhealthySecondThreshold": {"type": "integer"},
                "deploymentUnhealthySecondThreshold": {"type": "integer"},
                "rayClusterConfig": {
                    "type": "object",
                    "required": ["headGroupSpec"],
                    "properties": {
                        "rayVersion": {"type": "string"},
                        "enableInTreeAutoscaling": {"type": "boolean"},
                        "headGroupSpec": {
                            "type": "object",
                            "required": ["template"],
                            "properties": {
                                "rayStartParams": _START_PARAMS,
                                "template": _POD_TEMPLATE,
                            },
                        },
                        "workerGroupSpecs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["groupName", "template"],
                                "properties": {
                                    "groupName": {"type": "string"},
                                    "replicas": {"type": "integer", "minimum": 0},
                                    "minReplicas": {"type": "integer", "minimum": 0},
                                    "maxReplicas": {"type": "integer", "minimum": 0},
                                    "rayStartParams": _START_PARAMS,
                                    "template": _POD_TEMPLATE,
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def serve_config(document: dict) -> ServeDeploySchema:
    config = ServeDeploySchema.model_validate(document)
    for application in config.applications:
        assert application.import_path == "octavo.server.ray_serve.launch:app_builder"
        app_builder(application.args)  # every arg is an `octavo serve` flag
    return config


def test_the_serve_config_is_a_valid_octavo_application():
    config = serve_config(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))
    args = parse_flags(config.applications[0].args)
    assert (args.num_replicas, args.max_replicas, args.routing) == (2, 4, "prefix")


def test_the_rayservice_manifest_is_valid_and_gives_each_replica_a_gpu():
    manifest = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    jsonschema.validate(manifest, RAYSERVICE_SCHEMA)
    spec = manifest["spec"]
    config = serve_config(yaml.safe_load(spec["serveConfigV2"]))
    args = parse_flags(config.applications[0].args)
    assert args.device == "cuda"
    (gpu_group,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = gpu_group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"  # one replica per pod
    assert gpu_group["minReplicas"] >= args.num_replicas
    assert gpu_group["maxReplicas"] >= args.max_replicas
    assert spec["rayClusterConfig"]["rayVersion"] == "2.60.0"


def test_a_bad_flag_in_a_serve_config_is_refused():
    with pytest.raises(SystemExit):
        app_builder({"no_such_flag": 1})


def test_replica_counts_are_checked():
    with pytest.raises(ValueError, match="num-replicas"):
        app_builder({"num_replicas": 0})
    with pytest.raises(ValueError, match="max-replicas"):
        app_builder({"num_replicas": 3, "max_replicas": 2})
