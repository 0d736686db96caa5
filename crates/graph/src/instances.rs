//! Where [`CudaGraph::update_input_ptrs`](crate::CudaGraph::update_input_ptrs) sends a
//! graph's new input addresses: into the instance replays launch, or to another instance of
//! the same captured graph kept from an earlier update (beyond PyTorch, whose graphs read
//! fixed addresses).
//!
//! With one instance, a graph moving between a few sets of inputs (double buffers,
//! alternating batches) pays an update of every node that reads an input at each move.
//! Kept instances ([`CudaGraph::keep_instances`](crate::CudaGraph::keep_instances)) each
//! hold the addresses they were last given: a move to addresses one of them holds launches
//! it, with no driver call; a move to new addresses makes another instance while there is
//! room (`cuGraphInstantiate`), else updates the least recently launched one.
//!
//! An update gives the instance's changed nodes their new parameters one by one
//! ([`Driver::graph_exec_set_nodes`]), the captured graph left as it is. The captured graph
//! (the template instances are made from) is set only to make an instance, or when the
//! driver refuses a node: then the template takes the wanted nodes and the instance is
//! brought up to it whole (`cuGraphExecUpdate`), or made again.
use crate::repoint::{NodeMap, Plan};
use crate::{GraphError, InputMove, InputUpdate};
use ferrocuda_driver::Driver;
use ferrocuda_types::{DevicePtr, GraphExecHandle, GraphHandle, GraphNode};
use std::borrow::Cow;

/// An instance other than the one replays launch.
#[derive(Debug)]
struct Spare {
    exec: GraphExecHandle,
    nodes: Vec<GraphNode>,
}

/// The instances of one captured graph, with the nodes each holds.
#[derive(Debug)]
pub(crate) struct Instances {
    /// The nodes of the instance replays launch.
    current: NodeMap,
    /// The other instances, least recently launched first.
    spares: Vec<Spare>,
    /// What the captured graph holds.
    template: Template,
}

/// The nodes the captured graph holds; `None`: not known (after a failure).
#[derive(Debug)]
struct Template(Option<Vec<GraphNode>>);

impl Instances {
    /// The one instance of `graph`, whose nodes (those of `graph`) are read from the driver.
    pub(crate) fn read(driver: &dyn Driver, graph: GraphHandle) -> Result<Instances, GraphError> {
        let nodes = driver.graph_nodes(graph)?;
        Ok(Instances {
            template: Template(Some(nodes.clone())),
            current: NodeMap::new(nodes),
            spares: Vec::new(),
        })
    }

    /// What moving the addresses `moves` names changes in the instance replays launch.
    pub(crate) fn plan(&self, moves: &[InputMove]) -> Result<Plan, GraphError> {
        self.current.plan(moves)
    }

    /// What pointing the copies into `dst` at `src`, for each `(dst, src)`, changes in the
    /// instance replays launch (see [`NodeMap::copy_plan`]).
    pub(crate) fn copy_plan(&self, sources: &[(DevicePtr, DevicePtr)]) -> Result<Plan, GraphError> {
        self.current.copy_plan(sources)
    }

    /// Makes the changes `plan` says (planned against the instance replays launch), keeping
    /// at most `keep` instances (at least one); `exec` is the instance replays launch,
    /// before and after. On an error every instance holds what it held (best effort when
    /// the driver fails half way through an instance), and `exec` is unchanged.
    pub(crate) fn update(
        &mut self,
        driver: &dyn Driver,
        graph: GraphHandle,
        exec: &mut GraphExecHandle,
        keep: usize,
        plan: Plan,
    ) -> Result<InputUpdate, GraphError> {
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
        if self.spares.is_empty() && keep <= 1 {
            let (holders, nodes) = (self.current.holders(), self.current.nodes());
            let target = Target::Changes(&plan.changes);
            let to = Update {
                driver,
                graph,
                holders,
            };
            let in_place = to.bring_up(&mut self.template, exec, nodes, target)?;
            self.current.apply(plan.changes);
            return Ok(outcome(in_place, pointers));
        }
        let mut target = self.current.nodes().to_vec();
        for (i, node) in plan.changes {
            target[i] = node;
        }
        if self.spares.len() + 1 < keep {
            self.add(driver, graph, exec, target)?;
            return Ok(InputUpdate::Added { pointers });
        }
        let mut spare = self.spares.remove(0);
        let to = Update {
            driver,
            graph,
            holders: self.current.holders(),
        };
        let target_nodes = Target::Nodes(&target);
        let brought = to.bring_up(
            &mut self.template,
            &mut spare.exec,
            &spare.nodes,
            target_nodes,
        );
        match brought {
            Ok(in_place) => {
                spare.nodes = target;
                self.launch(exec, spare);
                Ok(outcome(in_place, pointers))
            }
            Err(e) => {
                self.spares.insert(0, spare);
                Err(e)
            }
        }
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
        self.spares.push(Spare {
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
        let to = Update {
            driver,
            graph,
            holders: self.current.holders(),
        };
        to.set_template(&mut self.template, &target)?;
        let spare = Spare {
            exec: driver.graph_instantiate(graph)?,
            nodes: target,
        };
        self.launch(exec, spare);
        Ok(())
    }

    /// Destroys spares, least recently launched first, until at most `keep` instances are
    /// left (at least one).
    pub(crate) fn trim(&mut self, driver: &dyn Driver, keep: usize) {
        while self.spares.len() + 1 > keep.max(1) {
            let spare = self.spares.remove(0);
            // One that cannot be destroyed only leaks.
            let _ = driver.graph_exec_destroy(spare.exec);
        }
    }
}

/// The driver calls that bring an instance of `graph` to new nodes, looking at the nodes
/// that may hold an address (`holders`; no other node ever differs).
struct Update<'a> {
    driver: &'a dyn Driver,
    graph: GraphHandle,
    holders: &'a [usize],
}

impl Update<'_> {
    /// Brings `exec`, which holds `nodes`, up to `target`: its changed nodes set one by one
    /// (`true`); when the driver refuses that, the template set to the target and `exec`
    /// updated whole from it (`true`) or made again (`false`). On an error `exec` is put
    /// back best effort.
    fn bring_up(
        &self,
        template: &mut Template,
        exec: &mut GraphExecHandle,
        nodes: &[GraphNode],
        target: Target<'_>,
    ) -> Result<bool, GraphError> {
        let (driver, graph) = (self.driver, self.graph);
        let changes = target.changes(self.holders, nodes);
        if driver.graph_exec_set_nodes(*exec, graph, &changes)? {
            return Ok(true);
        }
        let whole = target.nodes(nodes);
        let again = self.set_template(template, &whole).and_then(|()| {
            match driver.graph_exec_update(*exec, graph)? {
                true => Ok(None),
                false => Ok(Some(driver.graph_instantiate(graph)?)),
            }
        });
        match again {
            Ok(None) => Ok(true),
            Ok(Some(new)) => {
                // The new instance is in place; the old one, if it cannot be destroyed,
                // only leaks.
                let _ = driver.graph_exec_destroy(std::mem::replace(exec, new));
                Ok(false)
            }
            Err(e) => {
                let back = Target::Nodes(nodes).changes(self.holders, &whole);
                let _ = driver.graph_exec_set_nodes(*exec, graph, &back);
                Err(e)
            }
        }
    }

    /// Sets the template's nodes that may hold an address to `want`: those that differ from
    /// what it holds, or all of them when that is not known.
    fn set_template(&self, template: &mut Template, want: &[GraphNode]) -> Result<(), GraphError> {
        let held = template.0.take();
        let set = self.holders.iter().try_for_each(|&i| {
            let Some(node) = want.get(i) else {
                return Ok(());
            };
            if held.as_ref().and_then(|h| h.get(i)) == Some(node) {
                return Ok(());
            }
            self.driver.graph_set_node(self.graph, i, node)
        });
        if set.is_ok() {
            template.0 = Some(want.to_vec());
        }
        Ok(set?)
    }
}

/// What an instance is to hold: its nodes with these changes made, or these nodes.
#[derive(Clone, Copy)]
enum Target<'a> {
    Changes(&'a [(usize, GraphNode)]),
    Nodes(&'a [GraphNode]),
}

impl<'a> Target<'a> {
    /// The changes that bring an instance holding `nodes` to the target, by index (borrowed
    /// when the target is given as changes: no copy on the one-instance path).
    fn changes(self, holders: &[usize], nodes: &[GraphNode]) -> Cow<'a, [(usize, GraphNode)]> {
        match self {
            Target::Changes(changes) => Cow::Borrowed(changes),
            Target::Nodes(target) => (holders.iter())
                .filter_map(|&i| Some((i, target.get(i)?)))
                .filter(|(i, node)| nodes.get(*i) != Some(*node))
                .map(|(i, node)| (i, node.clone()))
                .collect::<Vec<_>>()
                .into(),
        }
    }

    /// The target's nodes, for an instance holding `nodes`.
    fn nodes(self, nodes: &[GraphNode]) -> Vec<GraphNode> {
        match self {
            Target::Changes(changes) => {
                let mut whole = nodes.to_vec();
                for (i, node) in changes {
                    if let Some(slot) = whole.get_mut(*i) {
                        *slot = node.clone();
                    }
                }
                whole
            }
            Target::Nodes(target) => target.to_vec(),
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
