//! The engine's requests, ordered by id, with cheap lookups.
//!
//! Request ids only grow, so appending keeps the table sorted and a lookup is a binary search
//! over a dense `Vec<u32>` (cache-friendly, unlike a tree of boxed nodes). Removal leaves a
//! tombstone; the table compacts itself when tombstones outnumber live requests. Iteration is in
//! id order, which the scheduler's "stable order" and determinism rely on.

use crate::ids::RequestId;
use crate::request::Request;

#[derive(Debug, Default)]
pub struct RequestTable {
    ids: Vec<RequestId>,
    slots: Vec<Option<Request>>,
    live: usize,
}

/// Tombstones tolerated before a compaction, so that closing one of few requests stays cheap.
const MIN_TOMBSTONES_BEFORE_COMPACTION: usize = 64;

impl RequestTable {
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    fn index(&self, id: &RequestId) -> Option<usize> {
        self.ids.binary_search(id).ok().filter(|&i| self.slots[i].is_some())
    }

    pub fn get(&self, id: &RequestId) -> Option<&Request> {
        self.index(id).and_then(|i| self.slots[i].as_ref())
    }

    pub fn get_mut(&mut self, id: &RequestId) -> Option<&mut Request> {
        self.index(id).and_then(|i| self.slots[i].as_mut())
    }

    /// Inserts a request whose id is larger than every id inserted before.
    pub fn insert(&mut self, id: RequestId, request: Request) {
        assert!(self.ids.last().is_none_or(|&last| last < id), "request ids must grow");
        self.ids.push(id);
        self.slots.push(Some(request));
        self.live += 1;
    }

    /// Removes a request, leaving a tombstone: positions stay valid until `compact`.
    pub fn remove(&mut self, id: &RequestId) -> Option<Request> {
        let i = self.index(id)?;
        let request = self.slots[i].take();
        self.live -= 1;
        request
    }

    /// Drops tombstones once they outnumber live requests. Moves positions: the engine calls it
    /// only when no transaction holds positions.
    pub fn compact_if_sparse(&mut self) {
        let tombstones = self.slots.len() - self.live;
        if tombstones > self.live && tombstones >= MIN_TOMBSTONES_BEFORE_COMPACTION {
            self.compact();
        }
    }

    fn compact(&mut self) {
        let mut kept = 0;
        for i in 0..self.slots.len() {
            if self.slots[i].is_some() {
                self.ids.swap(kept, i);
                self.slots.swap(kept, i);
                kept += 1;
            }
        }
        self.ids.truncate(kept);
        self.slots.truncate(kept);
    }

    /// Positions are stable until the next `compact_if_sparse`: plans carry them from planning to
    /// commit so that neither looks a request up twice.
    pub fn position(&self, id: &RequestId) -> Option<usize> {
        self.index(id)
    }

    pub fn at(&self, position: usize) -> &Request {
        self.slots[position].as_ref().expect("a live position")
    }

    pub fn at_mut(&mut self, position: usize) -> &mut Request {
        self.slots[position].as_mut().expect("a live position")
    }

    pub fn positions(&self) -> impl Iterator<Item = (usize, &Request)> {
        self.slots.iter().enumerate().filter_map(|(i, r)| r.as_ref().map(|r| (i, r)))
    }

    pub fn values(&self) -> impl Iterator<Item = &Request> {
        self.slots.iter().flatten()
    }

    pub fn keys(&self) -> impl Iterator<Item = &RequestId> + '_ {
        self.values().map(|r| &r.id)
    }
}

impl std::ops::Index<&RequestId> for RequestTable {
    type Output = Request;

    fn index(&self, id: &RequestId) -> &Request {
        self.get(id).unwrap_or_else(|| panic!("request {} is not in the table", id.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvManager, PagedKv};

    #[test]
    fn lookups_survive_removal_and_compaction() {
        let mut kv = PagedKv::new(1, 1, false);
        let mut table = RequestTable::default();
        for i in 1..=300 {
            table.insert(RequestId(i), Request::new(RequestId(i), kv.open(RequestId(i)), 10));
        }
        for i in (1..=300).filter(|i| i % 3 != 0) {
            assert!(table.remove(&RequestId(i)).is_some());
        }
        assert_eq!(table.position(&RequestId(3)), Some(2), "removal alone keeps positions");
        table.compact_if_sparse();
        assert_eq!(table.position(&RequestId(3)), Some(0));
        assert!(table.remove(&RequestId(1)).is_none());
        assert_eq!(table.len(), 100);
        assert!(table.values().map(|r| r.id.0).eq((1..=300).filter(|i| i % 3 == 0)));
        assert_eq!(table[&RequestId(150)].id, RequestId(150));
        assert!(table.get(&RequestId(151)).is_none());
        table.insert(RequestId(301), Request::new(RequestId(301), kv.open(RequestId(301)), 10));
        assert_eq!(table.keys().last(), Some(&RequestId(301)));
    }
}
