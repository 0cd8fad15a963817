"""Control policies: pure classes that see observations and return a `Decision` (action + reason).

- `SpeculationGate` (paper Eq. 5): speculate only where the acceptance pays for the draft.
- `CollectionGate` (paper Algorithm 1): collect, train and deploy only after the workload shifted.
- `RollbackGate`: after a hot-swap, confirm the draft or go back to the previous one.

None of them touches the engine, the store or the clock; the runtime feeds them and applies the result.
"""

from tide.control.collection import CollectAction, CollectionGate, CollectState
from tide.control.decision import Decision
from tide.control.rollback import RollbackAction, RollbackGate
from tide.control.speculation import LatencyModel, SpecAction, SpeculationGate, SpeculationObservation, cost_key

__all__ = [
    "CollectAction", "CollectState", "CollectionGate", "Decision", "LatencyModel", "RollbackAction", "RollbackGate",
    "SpecAction", "SpeculationGate", "SpeculationObservation", "cost_key",
]
