"""deploy/: the Ray Serve config and the KubeRay RayService manifest are valid and mean what
`octavo serve --ray` means. Ray Serve's own config schema checks the Serve configs; KubeRay's
ray.io/v1 RayService CRD schema (vendored, see schemas/README.md) checks the manifest the way
`kubectl apply` does by default (strict field validation: an unknown field is an error)."""

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from octavo.server.ray_serve.launch import app_builder
from octavo.server.server_args import ServerArgs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CRD_SCHEMA = Path(__file__).resolve().parent / "schemas" / "ray.io_rayservices.v1.spec.json"

# OpenAPI v3 extensions the API server enforces that JSON Schema cannot: CEL rules. The test
# refuses a manifest that reaches one, rather than passing it unchecked.
CEL_RULES = "x-kubernetes-validations"
PRESERVE_UNKNOWN = "x-kubernetes-preserve-unknown-fields"


def strict(schema: Any) -> Any:
    """The CRD's structural schema as JSON Schema with kubectl's strict field validation: an
    object that lists its properties accepts no others unless the CRD preserves unknown fields."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get(PRESERVE_UNKNOWN):
        out["additionalProperties"] = False
    return out


def schema_nodes(schema: dict, document: Any) -> Iterator[dict]:
    """Every schema node that `document` reaches through `properties`, `items` and
    `additionalProperties`."""
    yield schema
    if isinstance(document, dict):
        for key, value in document.items():
            sub = schema.get("properties", {}).get(key, schema.get("additionalProperties"))
            if isinstance(sub, dict):
                yield from schema_nodes(sub, value)
    elif isinstance(document, list) and isinstance(schema.get("items"), dict):
        for value in document:
            yield from schema_nodes(schema["items"], value)


def rayservice_errors(manifest: dict) -> list[str]:
    crd = json.loads(CRD_SCHEMA.read_text())
    assert not any(CEL_RULES in node for node in schema_nodes(crd, manifest)), (
        "the manifest sets a field with a CEL rule, which this test cannot evaluate"
    )
    validator = jsonschema.Draft7Validator(strict(crd))
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(manifest)
    ]


def serve_config(document: dict) -> ServeDeploySchema:
    config = ServeDeploySchema.model_validate(document)
    for application in config.applications:
        assert application.import_path == "octavo.server.ray_serve.launch:app_builder"
        app_builder(application.args)  # every arg is an `octavo serve` flag
    return config


def test_the_serve_config_is_a_valid_octavo_application():
    config = serve_config(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))
    args = ServerArgs.from_config(config.applications[0].args)
    assert (args.num_replicas, args.max_replicas, args.routing) == (2, 4, "prefix")


def test_the_rayservice_manifest_is_valid_and_gives_each_replica_a_gpu():
    manifest = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    assert rayservice_errors(manifest) == []
    spec = manifest["spec"]
    config = serve_config(yaml.safe_load(spec["serveConfigV2"]))
    args = ServerArgs.from_config(config.applications[0].args)
    assert args.engine.device == "cuda"
    (gpu_group,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = gpu_group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"  # one replica per pod
    assert gpu_group["minReplicas"] >= args.num_replicas
    assert gpu_group["maxReplicas"] >= args.max_replicas
    assert spec["rayClusterConfig"]["rayVersion"] == "2.60.0"


def test_a_bad_flag_in_a_serve_config_is_refused_by_name():
    with pytest.raises(ValueError, match="'no_such_flag'"):
        app_builder({"no_such_flag": 1})
    with pytest.raises(ValueError, match="'num_replicas' must be int"):
        app_builder({"num_replicas": "two"})


def test_ray_flags_are_checked():
    with pytest.raises(ValueError, match="num-replicas"):
        app_builder({"num_replicas": 0})
    with pytest.raises(ValueError, match="max-replicas"):
        app_builder({"num_replicas": 3, "max_replicas": 2})
    with pytest.raises(ValueError, match="stream-batching-ms"):
        app_builder({"stream_batching_ms": -1})


@pytest.mark.parametrize(
    ("mistake", "error"),
    [
        pytest.param(
            lambda s: s["rayClusterConfig"].update(workerGroupSpec=[]),
            "Additional properties are not allowed",
            id="unknown-field",
        ),
        pytest.param(
            lambda s: s["rayClusterConfig"]["workerGroupSpecs"][0].update(replicas="2"),
            "not of type",
            id="wrong-type",
        ),
        pytest.param(
            lambda s: s["rayClusterConfig"]["headGroupSpec"].pop("template"),
            "'template' is a required",
            id="missing-field",
        ),
        pytest.param(
            lambda s: s["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0][
                "resources"
            ]["limits"].update(cpu="four"),
            "does not match",
            id="bad-quantity",
        ),
    ],
)
def test_the_crd_schema_refuses_a_broken_rayservice(mistake, error):
    manifest = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    broken = copy.deepcopy(manifest)
    mistake(broken["spec"])
    assert any(error in message for message in rayservice_errors(broken)), rayservice_errors(broken)
