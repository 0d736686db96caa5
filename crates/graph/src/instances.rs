//! Where [`CudaGraph::update_input_ptrs`](crate::CudaGraph::update_input_ptrs) sends a
//! graph's new input addresses: into the instance replays launch, updated in place, or to
//! another instance of the same captured graph kept from an earlier update (beyond
//! PyTorch, whose graphs read fixed addresses).
//!
//! With one instance, a graph moving between a few sets of inputs (double buffers,
//! alternating batches) pays a driver update of every node that reads an input at each
//! move. Kept instances ([`CudaGraph::keep_instances`](crate::CudaGraph::keep_instances))
//! each hold the addresses they were last given: a move to addresses one of them holds
//! launches it, with no driver call; a move to new addresses makes another instance while
//! there is room (`cuGraphInstantiate`), else updates the least recently launched one.
//!
//! Instances are made and updated from the captured graph (their template), whose nodes are
//! set only then. Which instance the template matches is remembered; after a failure it is
//! not known, and the next use sets every node that may hold an address.
use crate::repoint::NodeMap;
use crate::{GraphError, InputMove, InputUpdate};
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{GraphExecHandle, GraphHandle, GraphNode};

/// An instance other than the one replays launch.
#[derive(Debug)]
struct Spare {
    id: u64,
    exec: GraphExecHandle,
    nodes: Vec<GraphNode>,
}

/// The instances of one captured graph, with the nodes each holds.
#[derive(Debug)]
pub(crate) struct Instances {
    /// The nodes of the instance replays launch.
    current: NodeMap,
    current_id: u64,
    /// The other instances, least recently launched first.
    spares: Vec<Spare>,
    /// The instance whose nodes the captured graph holds; `None`: not known.
    template: Option<u64>,
    next_id: u64,
}

impl Instances {
    /// The one instance of `graph`, whose nodes (those of `graph`) are read from the driver.
    pub(crate) fn read(driver: &dyn Driver, graph: GraphHandle) -> Result<Instances, GraphError> {
        Ok(Instances {
            current: NodeMap::new(driver.graph_nodes(graph)?),
            current_id: 0,
            spares: Vec::new(),
            template: Some(0),
            next_id: 1,
        })
    }

    /// Moves the addresses `moves` names, keeping at most `keep` instances (at least one);
    /// `exec` is the instance replays launch, before and after. On an error every instance
    /// holds what it held, and `exec` is unchanged.
    pub(crate) fn update(
        &mut self,
        driver: &dyn Driver,
        graph: GraphHandle,
        exec: &mut GraphExecHandle,
        keep: usize,
        moves: &[InputMove],
    ) -> Result<InputUpdate, GraphError> {
        let plan = self.current.plan(moves)?;
        let pointers = plan.pointers;
        if plan.changes.is_empty() {
            return Ok(InputUpdate::InPlace { pointers });
        }
        let held =
            (self.spares.iter()).position(|s| self.is_current_after(&s.nodes, &plan.changes));
        if let Some(i) = held {
            let spare = self.spares.remove(i);
            self.launch(exec, spare);
            return Ok(InputUpdate::Kept { pointers });
        }
        let target = || {
            let mut nodes = self.current.nodes().to_vec();
            for (i, node) in &plan.changes {
                nodes[*i] = node.clone();
            }
            nodes
        };
        if self.spares.len() + 1 < keep {
            let target = target();
            self.add(driver, graph, exec, target)?;
            return Ok(InputUpdate::Added { pointers });
        }
        if !self.spares.is_empty() {
            let target = target();
            let spare = self.spares.remove(0);
            let in_place = self.update_spare(driver, graph, exec, spare, target)?;
            return Ok(outcome(in_place, pointers));
        }
        let in_place = self.update_current(driver, graph, exec, plan.changes)?;
        Ok(outcome(in_place, pointers))
    }

    /// Whether `nodes` are the current instance's with `changes` (sorted by index) made,
    /// looking at the nodes that may hold an address (no other node ever differs).
    fn is_current_after(&self, nodes: &[GraphNode], changes: &[(usize, GraphNode)]) -> bool {
        let mut changes = changes.iter().peekable();
        self.current.holders().iter().all(|&i| {
            let want = match changes.next_if(|(at, _)| *at == i) {
                Some((_, node)) => Some(node),
                None => self.current.nodes().get(i),
            };
            nodes.get(i) == want
        })
    }

    /// Launches `spare` from now on; the instance launched until now becomes a spare.
    fn launch(&mut self, exec: &mut GraphExecHandle, spare: Spare) {
        let id = std::mem::replace(&mut self.current_id, spare.id);
        self.spares.push(Spare {
            id,
            exec: std::mem::replace(exec, spare.exec),
            nodes: self.current.replace_nodes(spare.nodes),
        });
    }

    /// Makes another instance, holding `target`, and launches it from now on.
    fn add(
        &mut self,
        driver: &dyn Driver,
        graph: GraphHandle,
        exec: &mut GraphExecHandle,
        target: Vec<GraphNode>,
    ) -> Result<(), GraphError> {
        self.set_template(driver, graph, None, &target)?;
        let added = driver.graph_instantiate(graph);
        let id = self.next_id;
        self.next_id += 1;
        self.template = added.is_ok().then_some(id);
        let spare = Spare {
            id,
            exec: added?,
            nodes: target,
        };
        self.launch(exec, spare);
        Ok(())
    }

    /// Brings `spare` (the least recently launched instance) to `target`, in place when the
    /// driver can (`true`), and launches it from now on. On an error it stays a spare.
    fn update_spare(
        &mut self,
        driver: &dyn Driver,
        graph: GraphHandle,
        exec: &mut GraphExecHandle,
        mut spare: Spare,
        target: Vec<GraphNode>,
    ) -> Result<bool, GraphError> {
        let changes: Vec<(usize, GraphNode)> = (self.current.holders().iter())
            .filter(|&&i| spare.nodes.get(i) != target.get(i))
            .filter_map(|&i| Some((i, target.get(i)?.clone())))
            .collect();
        let updated = self
            .set_template(driver, graph, Some(spare.id), &spare.nodes)
            .map_err(GraphError::from)
            .and_then(|()| bring_up(driver, graph, &mut spare.exec, &spare.nodes, &changes));
        match updated {
            Ok(in_place) => {
                spare.nodes = target;
                self.template = Some(spare.id);
                self.launch(exec, spare);
                Ok(in_place)
            }
            Err(e) => {
                self.template = None;
                self.spares.insert(0, spare);
                Err(e)
            }
        }
    }

    /// Makes `changes` in the instance replays launch, in place when the driver can
    /// (`true`).
    fn update_current(
        &mut self,
        driver: &dyn Driver,
        graph: GraphHandle,
        exec: &mut GraphExecHandle,
        changes: Vec<(usize, GraphNode)>,
    ) -> Result<bool, GraphError> {
        if self.template != Some(self.current_id) {
            let nodes = self.current.nodes().to_vec();
            self.set_template(driver, graph, Some(self.current_id), &nodes)?;
        }
        match bring_up(driver, graph, exec, self.current.nodes(), &changes) {
            Ok(in_place) => {
                self.current.apply(changes);
                self.template = Some(self.current_id);
                Ok(in_place)
            }
            Err(e) => {
                self.template = None;
                Err(e)
            }
        }
    }

    /// Sets the template's nodes that may hold an address to `want`, the nodes of instance
    /// `id` (`None`: of no instance yet): those that differ from what it holds, or all of
    /// them when that is not known.
    fn set_template(
        &mut self,
        driver: &dyn Driver,
        graph: GraphHandle,
        id: Option<u64>,
        want: &[GraphNode],
    ) -> Result<(), DriverError> {
        if id.is_some() && self.template == id {
            return Ok(());
        }
        let held = self.template.and_then(|t| self.nodes_of(t));
        let set = self.current.holders().iter().try_for_each(|&i| {
            let Some(node) = want.get(i) else {
                return Ok(());
            };
            if held.and_then(|h| h.get(i)) == Some(node) {
                return Ok(());
            }
            driver.graph_set_node(graph, i, node)
        });
        self.template = set.is_ok().then_some(id).flatten();
        set
    }

    /// The nodes instance `id` holds.
    fn nodes_of(&self, id: u64) -> Option<&[GraphNode]> {
        if id == self.current_id {
            return Some(self.current.nodes());
        }
        (self.spares.iter())
            .find(|s| s.id == id)
            .map(|s| s.nodes.as_slice())
    }

    /// Destroys spares, least recently launched first, until at most `keep` instances are
    /// left (at least one).
    pub(crate) fn trim(&mut self, driver: &dyn Driver, keep: usize) {
        while self.spares.len() + 1 > keep.max(1) {
            let spare = self.spares.remove(0);
            if self.template == Some(spare.id) {
                self.template = None;
            }
            // One that cannot be destroyed only leaks.
            let _ = driver.graph_exec_destroy(spare.exec);
        }
    }
}

/// Sets `changes` in the template, which holds `nodes` (those of `exec`), and brings
/// `exec` up to it: in place (`true`), or by instantiating it again (`false`). On an
/// error `exec` is as it was, and the template is put back best effort (the caller then
/// knows it no longer).
fn bring_up(
    driver: &dyn Driver,
    graph: GraphHandle,
    exec: &mut GraphExecHandle,
    nodes: &[GraphNode],
    changes: &[(usize, GraphNode)],
) -> Result<bool, GraphError> {
    let again = match driver.graph_update_nodes(*exec, graph, changes) {
        Ok(true) => return Ok(true),
        Ok(false) => driver.graph_instantiate(graph),
        Err(e) => Err(e),
    };
    match again {
        Ok(new) => {
            // The new instance is in place; the old one, if it cannot be destroyed,
            // only leaks.
            let _ = driver.graph_exec_destroy(std::mem::replace(exec, new));
            Ok(false)
        }
        Err(e) => {
            for (i, _) in changes {
                if let Some(node) = nodes.get(*i) {
                    let _ = driver.graph_set_node(graph, *i, node);
                }
            }
            Err(e.into())
        }
    }
}

/// The outcome of an update of an instance.
fn outcome(in_place: bool, pointers: usize) -> InputUpdate {
    if in_place {
        InputUpdate::InPlace { pointers }
    } else {
        InputUpdate::Reinstantiated { pointers }
    }
}
