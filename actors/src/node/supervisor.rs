//! The node's supervisor: an actor that starts the actors the node's roles call for, linked to
//! itself, and starts a new one in place of any that fails (or stops while the node is not
//! stopping). The node reaches its actors through an [`ActorTable`] the supervisor keeps
//! current; a restarted transfer-in actor is handed the producers' connections again.
//!
//! The jobs a failed actor held lose their reply port; the node sees that as
//! [`crate::JobError::ActorGone`] and hands them back to the queue (`work`), so a restart loses
//! no job.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex, RwLock};

use ractor::{Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, SpawnErr, SupervisionEvent};
use scd_transport::{Connection, JobReceiver};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::decode_loop::DecodeLoop;
use crate::decoder::{Decoder, DecoderArgs, DecoderMsg};
use crate::encoder::{Encoder, EncoderMsg};
use crate::halves::ProducerActors;
use crate::node::served::Served;
use crate::producer::{Producer, ProducerArgs, ProducerMsg};
use crate::transfer::{TransferIn, TransferInArgs, TransferInMsg, TransferOut, TransferOutMsg};

/// The node's actors as they are now.
#[derive(Default)]
pub(crate) struct Actors {
    producer: Option<ActorRef<ProducerMsg>>,
    encoder: Option<ActorRef<EncoderMsg>>,
    transfer_out: Option<ActorRef<TransferOutMsg>>,
    pub decoders: BTreeMap<String, ActorRef<DecoderMsg>>,
    pub transfer_in: Option<ActorRef<TransferInMsg>>,
}

impl Actors {
    /// The producer side's actors, on a node with the producer role.
    pub fn producer(&self) -> Option<ProducerActors> {
        Some(ProducerActors {
            producer: self.producer.clone()?,
            encoder: self.encoder.clone()?,
            transfer: self.transfer_out.clone()?,
        })
    }
}

/// Shared view of the node's current actors.
pub(crate) type ActorTable = Arc<RwLock<Actors>>;

/// Reads the table (a poisoned lock still holds valid refs: writers only swap them).
pub(crate) fn read(table: &ActorTable) -> std::sync::RwLockReadGuard<'_, Actors> {
    table.read().unwrap_or_else(|p| p.into_inner())
}

fn write(table: &ActorTable) -> std::sync::RwLockWriteGuard<'_, Actors> {
    table.write().unwrap_or_else(|p| p.into_inner())
}

/// One supervised actor, by what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Child {
    Producer,
    Encoder,
    TransferOut,
    TransferIn,
    Decoder(String),
}

impl Child {
    fn name(&self) -> String {
        match self {
            Child::Producer => "producer".into(),
            Child::Encoder => "encoder".into(),
            Child::TransferOut => "transfer-out".into(),
            Child::TransferIn => "transfer-in".into(),
            Child::Decoder(e) => format!("decoder:{e}"),
        }
    }
}

/// The supervisor actor.
pub(crate) struct Supervisor;

/// What the supervisor needs to (re)start the node's actors.
pub(crate) struct SupervisorArgs {
    pub served: Arc<Served>,
    pub producer_role: bool,
    pub consumer_role: bool,
    pub cancel: CancellationToken,
    /// Where the transfer-in actor hands job streams nobody expects.
    pub new_streams: mpsc::Sender<JobReceiver>,
    pub table: ActorTable,
    /// Connections from producer nodes, for a restarted transfer-in actor.
    pub inbound: Arc<StdMutex<Vec<Connection>>>,
    /// Restarts so far.
    pub restarts: Arc<AtomicU64>,
    /// The producer's prefix cache (kept across its restarts).
    pub prefix_cache: Option<Arc<crate::prefix_cache::PrefixCache>>,
    /// The consumer's decode loop, shared by its decoders (and their replacements).
    pub decode_loop: Option<DecodeLoop>,
}

/// The supervisor's state: its arguments and its children by actor id.
pub(crate) struct SupervisorState {
    args: SupervisorArgs,
    children: HashMap<ActorId, (Child, ActorCell)>,
}

/// Messages of the supervisor.
pub(crate) enum SupervisorMsg {
    /// Stop a child as if it had failed (the tests' way to check the restarts); whether the
    /// child exists.
    Kill(String, ractor::RpcReplyPort<bool>),
}

impl SupervisorState {
    async fn start(&mut self, myself: &ActorCell, child: Child) -> Result<(), SpawnErr> {
        let a = &self.args;
        let me = myself.clone();
        let cell = match &child {
            Child::Producer => {
                // A producer's node loaded the weights (Served::load); were they missing, the
                // child fails to start and the node with it.
                let model = a
                    .served
                    .model()
                    .map_err(|e| SpawnErr::StartupFailed(Box::new(e)))?;
                let args = ProducerArgs {
                    model: model.clone(),
                    prefix_cache: a.prefix_cache.clone(),
                    documents: a.served.documents.clone(),
                };
                let (r, _) = Actor::spawn_linked(None, Producer, args, me).await?;
                write(&a.table).producer = Some(r.clone());
                r.get_cell()
            }
            Child::Encoder => {
                let (r, _) = Actor::spawn_linked(None, Encoder, (), me).await?;
                write(&a.table).encoder = Some(r.clone());
                r.get_cell()
            }
            Child::TransferOut => {
                let (r, _) = Actor::spawn_linked(None, TransferOut, (), me).await?;
                write(&a.table).transfer_out = Some(r.clone());
                r.get_cell()
            }
            Child::TransferIn => {
                let args = TransferInArgs {
                    cancel: a.cancel.clone(),
                    unexpected: a.consumer_role.then(|| a.new_streams.clone()),
                };
                let (r, _) = Actor::spawn_linked(None, TransferIn, args, me).await?;
                let live: Vec<Connection> = {
                    let mut inbound = a.inbound.lock().unwrap_or_else(|p| p.into_inner());
                    inbound.retain(|c| !c.is_closed());
                    inbound.clone()
                };
                for c in live {
                    let _ = r.send_message(TransferInMsg::Connection(c));
                }
                write(&a.table).transfer_in = Some(r.clone());
                r.get_cell()
            }
            Child::Decoder(expert) => {
                let model = a
                    .served
                    .experts
                    .get(expert)
                    .and_then(|e| e.model.clone())
                    .ok_or_else(|| {
                        SpawnErr::StartupFailed(
                            format!("expert {expert}: a consumer needs the expert's model").into(),
                        )
                    })?;
                let decode_loop = a.decode_loop.clone().ok_or_else(|| {
                    SpawnErr::StartupFailed("a decoder needs the consumer's decode loop".into())
                })?;
                let args = DecoderArgs { model, decode_loop };
                let (r, _) = Actor::spawn_linked(None, Decoder, args, me).await?;
                write(&a.table).decoders.insert(expert.clone(), r.clone());
                r.get_cell()
            }
        };
        self.children.insert(cell.get_id(), (child, cell));
        Ok(())
    }
}

/// Spawns every actor `args` calls for under a new supervisor.
pub(crate) async fn start(
    args: SupervisorArgs,
) -> Result<(ActorRef<SupervisorMsg>, tokio::task::JoinHandle<()>), SpawnErr> {
    Actor::spawn(None, Supervisor, args).await
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut children = vec![Child::TransferIn];
        if args.producer_role {
            children.extend([Child::Producer, Child::Encoder, Child::TransferOut]);
        }
        if args.consumer_role {
            children.extend(args.served.experts.keys().cloned().map(Child::Decoder));
        }
        let mut state = SupervisorState {
            args,
            children: HashMap::new(),
        };
        let me = myself.get_cell();
        for child in children {
            state.start(&me, child).await?;
        }
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        for (_, cell) in state.children.values() {
            cell.stop(None);
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Kill(name, reply) => {
                let found = state
                    .children
                    .values()
                    .find(|(child, _)| child.name() == name)
                    .map(|(_, cell)| cell.clone());
                if let Some(cell) = &found {
                    cell.kill();
                }
                let _ = reply.send(found.is_some());
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match event {
            SupervisionEvent::ActorFailed(cell, e) => (cell, e.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "stopped".into()))
            }
            _ => return Ok(()),
        };
        let Some((child, _)) = state.children.remove(&cell.get_id()) else {
            return Ok(());
        };
        if state.args.cancel.is_cancelled() {
            return Ok(());
        }
        tracing::warn!(
            actor = child.name(),
            reason = why,
            "actor ended; starting a new one"
        );
        state.start(&myself.get_cell(), child.clone()).await?;
        state.args.restarts.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}
