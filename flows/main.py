"""`make run`: the main job. Until the training flow lands, this runs the most complete part of
the pipeline that exists: a round trip of the object store and the data contracts."""

from tasks.storage import Store
from schemas.tables import TRAJECTORIES


def main():
    print("rlvr-flows: the training flow is not built yet; running the storage round trip that exists.")
    from tests.rows import trajectory_row

    store = Store()
    table = TRAJECTORIES.from_rows([trajectory_row(i, run_id="demo") for i in range(16)])
    commit = store.write_stage("demo", 0, "trajectories", table, overwrite=True)
    back = store.read_stage("demo", 0, "trajectories")
    print(f"wrote and read back {back.num_rows} validated trajectories at {store.uri(commit.key)}")


if __name__ == "__main__":
    main()
