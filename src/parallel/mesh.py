"""One device mesh for every kind of parallelism, and which of its dims the data is split over.

The mesh always has the three named dims ("data_parallel", "pipeline_parallel", "tensor_parallel"),
in that order (tensor parallel innermost: its ranks are neighbours, on one node), sizes from config
and 1 for what is not used. Strategies build it once (OwnMesh) and declare its data-parallel dim as their
`data_mesh` (src/parallel/capabilities.py): the samplers (src/parallel/samplers.py) read it from the trainer's
strategy and shard the data over the data-parallel ranks only, so every rank of one pipeline or tensor-parallel
group reads the same samples.

    mesh = build_mesh(world_size, "cpu", pipeline_parallel=2)   # data_parallel = world_size / 2
    mesh["pipeline_parallel"].get_group()                       # this rank's pipeline group
    mesh["data_parallel"]                                       # what the samplers deal the data over
"""

from __future__ import annotations

from typing import Optional, Union

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from src.utils.config import ConfigError, check_int, check_number

DIMS = ("data_parallel", "pipeline_parallel", "tensor_parallel")
KEYS = {
    "data_parallel": "trainer.strategy.data_parallel_size",
    "pipeline_parallel": "trainer.strategy.pipeline_parallel_size",
    "tensor_parallel": "trainer.strategy.tensor_parallel_size",
}


def mesh_sizes(
    world_size: int, data_parallel: Union[int, str] = "auto", pipeline_parallel: int = 1, tensor_parallel: int = 1
) -> dict[str, int]:
    """The size of each dim; data_parallel="auto" takes what the others leave. One sentence if they do not fit."""
    for dim, size in (("pipeline_parallel", pipeline_parallel), ("tensor_parallel", tensor_parallel)):
        check_int(KEYS[dim], size)
    model = pipeline_parallel * tensor_parallel
    if data_parallel == "auto":
        if world_size % model:
            split = [
                f"{dim}_size={size}" for dim, size in zip(DIMS[1:], (pipeline_parallel, tensor_parallel)) if size > 1
            ]
            raise ConfigError(
                f"{world_size} process(es) do not divide into {' x '.join(split)}"
                + (f" = {model}" if len(split) > 1 else "")
                + f": set trainer.devices (x trainer.num_nodes) to a multiple of {model}."
            )
        data_parallel = world_size // model
    sizes = {"data_parallel": data_parallel, "pipeline_parallel": pipeline_parallel, "tensor_parallel": tensor_parallel}
    check_number(KEYS["data_parallel"], data_parallel, lambda v: v >= 1, "an integer >= 1 or auto", integer=True)
    if data_parallel * model != world_size:
        raise ConfigError(
            f"The world size {world_size} is not data_parallel_size={data_parallel} x pipeline_parallel_size="
            f"{pipeline_parallel} x tensor_parallel_size={tensor_parallel} = {data_parallel * model}: change "
            "trainer.devices (x trainer.num_nodes) or the sizes so that the product is the world size."
        )
    return sizes


def build_mesh(world_size: int, device_type: str = "cpu", **sizes: Union[int, str]) -> DeviceMesh:
    """The (data_parallel, pipeline_parallel, tensor_parallel) mesh over all ranks (a collective: every rank calls it)."""
    shape = mesh_sizes(world_size, **sizes)
    return init_device_mesh(device_type, tuple(shape[d] for d in DIMS), mesh_dim_names=DIMS)


class OwnMesh:
    """For a Lightning ModelParallelStrategy (listed before it among the bases): this module's mesh instead of
    Lightning's, which is built (every rank data parallel) and unused, since Lightning's has no pipeline dim.
    The strategy says its sizes in `mesh_dims()`; the samplers split data over the mesh's data-parallel dim."""

    mesh: Optional[DeviceMesh] = None
    data_mesh: Optional[DeviceMesh] = None  # its data-parallel dim, the capability the samplers read (capabilities.py)

    def mesh_dims(self) -> dict[str, int]:
        return {}

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh if self.mesh is not None else super().device_mesh

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = self.num_nodes * self.num_processes, 1
        super().setup_environment()
        self.mesh = build_mesh(self.world_size, self.root_device.type, **self.mesh_dims())
        self.data_mesh = self.mesh["data_parallel"]
