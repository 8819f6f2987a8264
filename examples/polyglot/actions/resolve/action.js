// `resolve` (JavaScript): looks the order up and, for a refund, issues it.
//
// Handles `resolve` events from `classify` (Python). The refund's id comes from
// crypto.randomUUID() and its time from Date.now(): both durable, so when the run is
// replayed after a crash the refund service is asked again with the same id, and can tell
// it is the same refund.

import { action } from 'rewind';

export const run = action((ctx, event) => {
  const ticket = event.payload;
  const order = ctx.call('orders.lookup', { order_id: ticket.order_id });

  let refund = null;
  if (ticket.intent === 'refund') {
    refund = {
      refund_id: crypto.randomUUID(),
      order_id: order.order_id,
      requested_at: new Date(Date.now()).toISOString(),
    };
    ctx.call('refunds.issue', refund);
    ctx.info(`refund ${refund.refund_id} issued for order ${order.order_id}`);
  }

  ctx.output({
    request_id: ticket.request_id,
    intent: ticket.intent,
    order_id: order.order_id,
    status: order.status,
    refund_id: refund?.refund_id ?? null,
    reply: refund
      ? `Your refund for order ${order.order_id} is on its way.`
      : `Your order ${order.order_id} is ${order.status}` +
        (order.eta_days > 0 ? `, arriving in ${order.eta_days} day(s).` : '.'),
  });
});
