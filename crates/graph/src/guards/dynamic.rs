//! Automatic dynamic shapes: which dims the next compile leaves unguarded
//! (`automatic_dynamic_shapes`, Dynamo's per-frame `FrameStateSizeEntry` in
//! `torch/_dynamo/pgo.py` and its use in `torch/_dynamo/variables/builder.py`).
//!
//! Each compile merges the inputs it saw into a per-input record: a size or stride that
//! differs from the recorded one becomes dynamic for good, and a rank change makes the whole
//! input dynamic. The compile then guards only what is still static. So the first compile is
//! fully static, and the first size change recompiles once with that dim dynamic, after
//! which other sizes of it hit. A size and a stride are tracked separately, as Dynamo does:
//! a contiguous input whose inner size changes also changes its outer stride, so both turn
//! dynamic in the same recompile.
use super::tensor::{TensorGuard, TensorMeta};

/// What is known about one input position across compiles.
#[derive(Clone, Debug, PartialEq, Eq)]
enum InputRecord {
    /// Per dim the size and stride seen so far, `None` once they differed.
    Dims {
        sizes: Vec<Option<i64>>,
        strides: Vec<Option<i64>>,
    },
    /// The rank changed: every dim is dynamic, whatever the rank.
    AllDynamic,
}

impl InputRecord {
    fn merge(&mut self, input: &TensorMeta<'_>) {
        let InputRecord::Dims { sizes, strides } = self else {
            return;
        };
        if sizes.len() != input.sizes().len() {
            *self = InputRecord::AllDynamic;
            return;
        }
        let forget = |known: &mut Vec<Option<i64>>, seen: &[i64]| {
            for (k, s) in known.iter_mut().zip(seen) {
                if *k != Some(*s) {
                    *k = None;
                }
            }
        };
        forget(sizes, input.sizes());
        forget(strides, input.strides());
    }

    fn guard(&self, input: &TensorMeta<'_>) -> TensorGuard {
        match self {
            InputRecord::Dims { sizes, strides } => {
                TensorGuard::with_dims(input, sizes.clone(), strides.clone())
            }
            InputRecord::AllDynamic => {
                let rank = input.sizes().len();
                TensorGuard::with_dims(input, vec![None; rank], vec![None; rank])
            }
        }
    }
}

/// The per-input records of one wrapped function (Dynamo's `frame_state`).
#[derive(Clone, Debug, Default)]
pub(crate) struct ShapeHistory {
    inputs: Vec<InputRecord>,
}

impl ShapeHistory {
    /// Merges a compile's inputs and returns their guards: exact on the first compile of an
    /// input position, dynamic where its history has changed.
    pub(crate) fn merge(&mut self, inputs: &[TensorMeta<'_>]) -> Vec<TensorGuard> {
        inputs
            .iter()
            .enumerate()
            .map(|(i, input)| match self.inputs.get_mut(i) {
                Some(record) => {
                    record.merge(input);
                    record.guard(input)
                }
                None => {
                    let record = InputRecord::Dims {
                        sizes: input.sizes().iter().map(|s| Some(*s)).collect(),
                        strides: input.strides().iter().map(|s| Some(*s)).collect(),
                    };
                    self.inputs.push(record);
                    TensorGuard::exact(input)
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use ferrocuda_types::{DType, DeviceIndex};

    use super::*;

    fn meta<'a>(
        sizes: &'a [i64],
        strides: &'a [i64],
    ) -> Result<TensorMeta<'a>, super::super::GuardError> {
        TensorMeta::new(DType::F32, DeviceIndex(0), false, sizes, strides)
    }

    #[test]
    fn a_changed_size_and_stride_turn_dynamic_and_stay_so() -> Result<(), Box<dyn std::error::Error>>
    {
        let mut h = ShapeHistory::default();
        let first = h.merge(&[meta(&[4, 8], &[8, 1])?]);
        assert_eq!(first, [TensorGuard::exact(&meta(&[4, 8], &[8, 1])?)]);
        let second = h.merge(&[meta(&[4, 16], &[16, 1])?]);
        assert_eq!(second[0].sizes(), [Some(4), None]);
        assert_eq!(second[0].strides(), [None, Some(1)]);
        let third = h.merge(&[meta(&[4, 8], &[8, 1])?]);
        assert_eq!(third[0].sizes(), [Some(4), None]);
        let rank = h.merge(&[meta(&[4, 8, 2], &[16, 2, 1])?]);
        assert_eq!(rank[0].sizes(), [None; 3]);
        assert_eq!(rank[0].strides(), [None; 3]);
        Ok(())
    }
}
