"""Communication graphs and mixing matrices for decentralized learning.

Consensus-based algorithms only reach agreement when agents talk over a connected graph and mix
their parameters with a matrix whose rows sum to one (every update is a weighted average) and, for
the consensus to be the *plain* mean, whose columns sum to one as well. This package builds the
graphs used in the experiments, derives mixing matrices from them, checks those assumptions, and
summarises a graph by the quantities the paper reports, chiefly the normalized Fiedler value
λ₂(Laplacian) / N, which is 1 for the complete graph and approaches 0 as the graph thins out.

Every graph has nodes ``0 .. N-1``; agent ``i`` is node ``i``, and row ``i`` of a mixing matrix is
the averaging weights agent ``i`` applies to itself and its neighbours.

* :mod:`~decentdp.topology.graphs`: the graph kinds, the checks of their parameters (:func:`check_graph_params`)
  and their construction (:func:`make_graph`);
* :mod:`~decentdp.topology.mixing`: mixing matrices from a graph, and their validation;
* :mod:`~decentdp.topology.checks`: connectivity, the Laplacian spectrum, :class:`GraphReport`, parameter checks;
* :mod:`~decentdp.topology.build`: the :class:`Topology` a run uses (:func:`build_topology`,
  :func:`topology_from_matrix`).
"""

from decentdp.topology.build import Topology, build_topology, topology_from_matrix
from decentdp.topology.checks import GraphReport, check_connected, describe, laplacian_spectrum
from decentdp.topology.graphs import GRAPH_KINDS, GRAPH_PARAMS, PARAM_USERS, check_graph_params, make_graph
from decentdp.topology.mixing import MIXING_KINDS, mixing_matrix, validate_mixing

__all__ = ["GRAPH_KINDS", "GRAPH_PARAMS", "MIXING_KINDS", "PARAM_USERS", "GraphReport", "Topology", "build_topology",
           "check_connected", "check_graph_params", "describe", "laplacian_spectrum", "make_graph", "mixing_matrix",
           "topology_from_matrix", "validate_mixing"]
