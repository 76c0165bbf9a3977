"""How a job's ranks divide the work: the one place that knows world size = pipeline stages x data-parallel ranks.

The batch keys of a ds_config count data-parallel ranks (ranks that see different data), the data order is
split over them, and the chart's world size counts every rank. main.py, data.py, dsconfig.py and the glue read
these properties instead of dividing again.
"""

from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout the ranks cannot form; says which number is wrong."""


@dataclass(frozen=True)
class Layout:
    world_size: int  # every rank of the job: workers x GPUs per worker
    pipeline_stages: int = 1  # model.pipeline_stages of the train package; 1 for any other program

    def __post_init__(self):
        for name in ("world_size", "pipeline_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be an integer >= 1, got {value!r}")
        if self.world_size % self.pipeline_stages:
            raise LayoutError(f"model.pipeline_stages {self.pipeline_stages} must divide the world size "
                              f"{self.world_size}: world size = pipeline stages x data-parallel ranks")

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data (what the batch keys count)."""
        return self.world_size // self.pipeline_stages

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank of global rank `rank`: stage s, data-parallel rank d is rank s x dp + d."""
        return rank % self.data_parallel

    def describe(self) -> str:
        """'2 data-parallel ranks', or with pipeline stages '2 data-parallel ranks (4 ranks / 2 pipeline stages)'."""
        text = f"{self.data_parallel} data-parallel rank{'s' if self.data_parallel > 1 else ''}"
        if self.pipeline_stages > 1:
            text += f" ({self.world_size} ranks / {self.pipeline_stages} pipeline stages)"
        return text
