"""The demo DAG at its default size (``deferral demo`` writes its own file, with the sizes
asked for, into a folder of its home)."""

from engine import DAG
from engine.demo.dag import DAG_ID, DESCRIPTION, add_demo_tasks

with DAG(dag_id=DAG_ID, description=DESCRIPTION):
    add_demo_tasks()
